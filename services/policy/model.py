"""The policy: the single, declarative source of what every node may see and do.

A policy document (YAML or JSON) declares the state keys (each with a type and
an authority layer), the nodes (what each reads and writes, at which layer, and
its patch size limit), CEL invariants every candidate state must satisfy, and
risk rules whose matches are parked for approval. It is validated whole when
loaded: a bad policy stops start-up with messages naming the offending entry and
its line, and is never half-applied. Its digest, recorded in every ledger
record, is SHA-256 over its body: the RFC 8785 bytes of the document as parsed
(YAML 1.1 through PyYAML's safe loader, or JSON), with nothing normalised or
defaulted. The body is what the service keeps in ``ztate.policies`` and bundles
carry, so that every policy version a record names can be retrieved and checked.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ztate.contract.canonical import canonical_bytes, parse_object, sha256_hex
from ztate.contract.errors import ContractError
from ztate.contract.files import FileTooLarge, read_bounded
from ztate.services.policy.rules import Expression, ExpressionError, bind, merge_reads
from ztate.services.policy.schema import (
    MAX_TYPE_DEPTH,
    BooleanType,
    EnumType,
    IntegerType,
    ListType,
    NumberType,
    ObjectType,
    StateValidator,
    StringType,
    TimestampType,
    UuidType,
    type_depth,
)
from ztate.services.runtime.identity import NAME

POLICY_FORMAT = 1
# a policy file is a few KB of YAML; one over 4 MiB is refused, read no further
MAX_POLICY_FILE = 4 * 1024 * 1024
KeyName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
NodeName = Annotated[str, StringConstraints(pattern=NAME.pattern)]
RuleName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]


class PolicyError(ValueError):
    """The policy is invalid; the message names each offending entry and its line."""


class Layer(enum.StrEnum):
    """Authority layers, highest first. A lower layer never overrides a higher one."""

    CORE = "core"
    CHARACTERISTICS = "characteristics"
    SHARED = "shared"
    DELEGATED = "delegated"
    WORKING = "working"
    MEMORY = "memory"

    @property
    def rank(self) -> int:
        """0 for core (highest authority) to 5 for memory."""
        return _LAYER_RANK[self]

    @property
    def immutable(self) -> bool:
        """Core and characteristics are set at thread creation and never change."""
        return self in (Layer.CORE, Layer.CHARACTERISTICS)


_LAYER_RANK: dict[Layer, int] = {layer: rank for rank, layer in enumerate(Layer)}


class _KeyAttributes(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    layer: Annotated[Layer, Field(strict=False)]
    # the credential detector's entropy heuristic skips opaque keys (digests, ids)
    opaque: bool = False
    # reviewers see a digest instead of the value of a sensitive key
    sensitive: bool = False


class StringKey(StringType, _KeyAttributes):
    pass


class IntegerKey(IntegerType, _KeyAttributes):
    pass


class NumberKey(NumberType, _KeyAttributes):
    pass


class BooleanKey(BooleanType, _KeyAttributes):
    pass


class EnumKey(EnumType, _KeyAttributes):
    pass


class UuidKey(UuidType, _KeyAttributes):
    pass


class TimestampKey(TimestampType, _KeyAttributes):
    pass


class ListKey(ListType, _KeyAttributes):
    pass


class ObjectKey(ObjectType, _KeyAttributes):
    pass


KeySpec = Annotated[
    StringKey
    | IntegerKey
    | NumberKey
    | BooleanKey
    | EnumKey
    | UuidKey
    | TimestampKey
    | ListKey
    | ObjectKey,
    Field(discriminator="type"),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class WakeSpec(_Strict):
    """When a node has work on a thread (``SubscribeWork``): a version wakes it when
    another identity's transition changed a key of its projection and, if given,
    one of ``keys`` (changes of these keys wake it) and ``when`` (a CEL condition
    over its own projection, ``state``, at that version) holds."""

    keys: list[KeyName] | None = Field(default=None, min_length=1)
    when: str | None = Field(default=None, min_length=1, max_length=4096)


class NodeSpec(_Strict):
    """What one node may see and change."""

    layer: Annotated[Layer, Field(strict=False)]
    read: list[KeyName] = Field(default_factory=list)
    write: list[KeyName] = Field(default_factory=list)
    max_patch_bytes: int | None = Field(default=None, gt=0, le=4 * 1024 * 1024)
    # Whole ledger records (GetTransition, GetCheckpoint) reveal the digest of the
    # whole state, an oracle for guessing values the node may not read: only
    # nodes marked here (the privileged workers that verify before acting) get them.
    read_records: bool = False
    # When the server hands the node work on a thread; absent: never (it may still
    # watch threads it is told about).
    wake: WakeSpec | None = None


class InvariantSpec(_Strict):
    """A CEL expression every candidate state must satisfy."""

    name: RuleName
    expression: str = Field(min_length=1)
    message: str = ""


class RiskRuleSpec(_Strict):
    """A change that needs human approval: touching ``keys``, or ``expression`` true."""

    name: RuleName
    keys: list[KeyName] | None = None
    expression: str | None = None
    approvals: int = Field(default=1, ge=1, le=16)
    message: str = ""


class PolicyDocument(_Strict):
    """The policy file as written."""

    format: int
    name: NodeName
    description: str = ""
    keys: dict[KeyName, KeySpec] = Field(min_length=1)
    nodes: dict[NodeName, NodeSpec]
    invariants: list[InvariantSpec] = Field(default_factory=list)
    risk: list[RiskRuleSpec] = Field(default_factory=list)


@dataclass(frozen=True)
class Invariant:
    name: str
    expression: Expression
    message: str


@dataclass(frozen=True)
class Wake:
    """A node's compiled wake declaration."""

    keys: frozenset[str] | None
    when: Expression | None


@dataclass(frozen=True)
class RiskRule:
    name: str
    keys: frozenset[str]
    expression: Expression | None
    approvals: int
    message: str


Problem = tuple[tuple[str | int, ...], str]


def _cross_check(
    doc: PolicyDocument,
) -> tuple[list[Problem], list[Invariant], list[RiskRule], dict[str, Wake]]:
    """What a schema alone cannot say: references resolve, layers are respected."""
    problems: list[Problem] = []
    declared = frozenset(doc.keys)
    if doc.format != POLICY_FORMAT:
        problems.append((("format",), f"unsupported policy format {doc.format}"))
    for key, key_spec in doc.keys.items():
        if type_depth(key_spec) > MAX_TYPE_DEPTH:
            problems.append((("keys", key), f"nests deeper than {MAX_TYPE_DEPTH} levels"))
    for node_name, node in doc.nodes.items():
        if node.layer.immutable:
            problems.append(
                (("nodes", node_name, "layer"), f"nodes act at shared or below, not {node.layer}")
            )
        for verb, keys in (("read", node.read), ("write", node.write)):
            for index, key in enumerate(keys):
                if key not in declared:
                    problems.append(
                        ((("nodes", node_name, verb, index)), f"undeclared key {key!r}")
                    )
        for index, key in enumerate(node.write):
            spec = doc.keys.get(key)
            if spec is None:
                continue
            where = ("nodes", node_name, "write", index)
            if spec.layer.immutable:
                problems.append(
                    (
                        where,
                        f"grants write access to {spec.layer} key {key!r}; core and "
                        "characteristics keys are set only when a thread is created",
                    )
                )
            elif spec.layer.rank < node.layer.rank:
                problems.append(
                    (
                        where,
                        f"key {key!r} is in layer {spec.layer}, above the node's layer "
                        f"{node.layer}: a lower layer never overrides a higher one",
                    )
                )
    invariants: list[Invariant] = []
    rules: list[RiskRule] = []
    wakes: dict[str, Wake] = {}
    for node_name, node in doc.nodes.items():
        if node.wake is not None:
            wake = _compile_wake(node_name, node, node.wake, declared, problems)
            if wake is not None:
                wakes[node_name] = wake
    for kind, names in (
        ("invariants", [inv.name for inv in doc.invariants]),
        ("risk", [rule.name for rule in doc.risk]),
    ):
        for index, name in enumerate(names):
            if names.index(name) != index:
                problems.append(((kind, index, "name"), f"duplicate rule name {name!r}"))
    for index, inv in enumerate(doc.invariants):
        try:
            invariants.append(
                Invariant(inv.name, Expression.compile(inv.expression, declared), inv.message)
            )
        except ExpressionError as exc:
            problems.append((("invariants", index, "expression"), str(exc)))
    for index, rule in enumerate(doc.risk):
        if (rule.keys is None) == (rule.expression is None):
            problems.append((("risk", index), "give exactly one of keys or expression"))
            continue
        expression = None
        if rule.expression is not None:
            try:
                expression = Expression.compile(rule.expression, declared)
            except ExpressionError as exc:
                problems.append((("risk", index, "expression"), str(exc)))
                continue
        unknown = sorted(set(rule.keys or ()) - declared)
        if unknown:
            problems.append((("risk", index, "keys"), f"undeclared keys {unknown}"))
            continue
        rules.append(
            RiskRule(
                rule.name, frozenset(rule.keys or ()), expression, rule.approvals, rule.message
            )
        )
    return problems, invariants, rules, wakes


def _compile_wake(
    node_name: str,
    node: NodeSpec,
    spec: WakeSpec,
    declared: frozenset[str],
    problems: list[Problem],
) -> Wake | None:
    """A wake declaration sees only the node's own projection: a node is never woken
    by, nor told about, a key it may not read."""
    where = ("nodes", node_name, "wake")
    readable = frozenset(node.read)
    if spec.keys is None and spec.when is None:
        problems.append((where, "give keys, when, or both"))
        return None
    found = len(problems)
    for index, key in enumerate(spec.keys or ()):
        if key not in readable:
            problems.append(
                (
                    (*where, "keys", index),
                    f"key {key!r} is not in the node's read list: a node is woken only "
                    "by keys it may read",
                )
            )
    expression = None
    if spec.when is not None:
        try:
            expression = Expression.compile(spec.when, declared)
        except ExpressionError as exc:
            problems.append(((*where, "when"), str(exc)))
        else:
            others = sorted(set(expression.reads) - {"state"})
            hidden = sorted(expression.keys - readable)
            if others:
                problems.append(
                    (
                        (*where, "when"),
                        f"uses {others}; a wake condition sees only state, the node's "
                        "own projection",
                    )
                )
            elif hidden:
                problems.append(
                    (
                        (*where, "when"),
                        f"reads keys the node may not read: {hidden}",
                    )
                )
    if len(problems) > found:
        return None
    return Wake(frozenset(spec.keys) if spec.keys is not None else None, expression)


class Policy:
    """A validated policy, indexed for the proposal path."""

    def __init__(
        self,
        document: PolicyDocument,
        body: bytes,
        invariants: list[Invariant],
        risk_rules: list[RiskRule],
        wakes: dict[str, Wake] | None = None,
    ) -> None:
        self.document = document
        self.name = document.name
        # the RFC 8785 bytes of the document as written, and their SHA-256: the one
        # definition of the policy digest (docs/ledger-format.md, "The policy digest")
        self.body = body
        self.digest = sha256_hex(body)
        self.keys = frozenset(document.keys)
        self.invariants = tuple(invariants)
        self.risk_rules = tuple(risk_rules)
        self.opaque_keys = frozenset(k for k, spec in document.keys.items() if spec.opaque)
        self.reads = merge_reads(
            [inv.expression for inv in invariants]
            + [rule.expression for rule in risk_rules if rule.expression is not None]
        )
        self.validator = StateValidator(document.name, dict(document.keys))
        self._readable = {name: frozenset(node.read) for name, node in document.nodes.items()}
        self._writable = {name: frozenset(node.write) for name, node in document.nodes.items()}
        self.wakes: dict[str, Wake] = dict(wakes or {})

    def woken(
        self, changed: frozenset[str], state: dict[str, Any], author: str | None
    ) -> list[str]:
        """The nodes a version wakes (their wake declarations, docs/policy.md): it was
        made by another node than ``author`` (``None``: an operator or the service),
        it changed ``changed`` keys of their projection, and their declaration holds."""
        woken = []
        for name, wake in self.wakes.items():
            if name == author:
                continue  # a node's own transition never wakes it
            readable = self._readable[name]
            seen = changed & readable
            if not seen or (wake.keys is not None and not seen & wake.keys):
                continue
            if wake.when is not None:
                projection = {key: state[key] for key in state.keys() & readable}
                if not wake.when.holds(bind(wake.when.reads, {"state": projection})):
                    continue
            woken.append(name)
        return woken

    def is_registered(self, node: str) -> bool:
        return node in self._readable

    def readable(self, node: str) -> frozenset[str]:
        return self._readable[node]

    def writable(self, node: str) -> frozenset[str]:
        return self._writable[node]

    def reads_records(self, node: str) -> bool:
        """Whether ``node`` may read whole ledger records and checkpoints."""
        return self.document.nodes[node].read_records

    def node_layer(self, node: str) -> Layer:
        return self.document.nodes[node].layer

    def key_layer(self, key: str) -> Layer:
        return self.document.keys[key].layer

    def max_patch_bytes(self, node: str) -> int | None:
        return self.document.nodes[node].max_patch_bytes

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        return sorted(set(keys) - self.keys)

    @classmethod
    def from_mapping(cls, raw: Any, *, source: str, lines: yaml.Node | None = None) -> Policy:
        """Validate a parsed document; ``lines`` (its YAML node tree) adds line numbers."""
        try:
            document = PolicyDocument.model_validate(raw)
        except ValidationError as exc:
            problems: list[Problem] = [
                (tuple(err["loc"]), err["msg"])
                for err in exc.errors(include_input=False, include_url=False)
            ]
            raise PolicyError(_describe(source, problems, lines)) from None
        problems, invariants, rules, wakes = _cross_check(document)
        if problems:
            raise PolicyError(_describe(source, problems, lines))
        try:
            body = canonical_bytes(raw)
        except (ValueError, TypeError):
            raise PolicyError(f"{source}: holds values JSON cannot represent") from None
        return cls(document, body, invariants, rules, wakes)

    @classmethod
    def from_body(cls, body: bytes, *, source: str) -> Policy:
        """A policy from its body (the RFC 8785 bytes its digest is taken over, as
        ``ztate.policies`` and bundles keep it). ``PolicyError`` when the bytes are
        not the canonical JSON of a valid policy."""
        try:
            raw = parse_object(body, what=source, max_depth=MAX_BODY_DEPTH)
        except ContractError as exc:
            raise PolicyError(exc.message) from None
        policy = cls.from_mapping(raw, source=source)
        if policy.body != body:
            raise PolicyError(f"{source}: not in its RFC 8785 (canonical) form")
        return policy

    @classmethod
    def load(cls, path: Path) -> Policy:
        """Load and validate a policy file (.yaml, .yml or .json)."""
        try:
            text = read_bounded(path, MAX_POLICY_FILE, "a policy file").decode("utf-8")
        except OSError as exc:
            raise PolicyError(f"{path}: cannot read policy ({exc.strerror})") from None
        except FileTooLarge as exc:
            raise PolicyError(str(exc)) from None
        except UnicodeDecodeError:
            raise PolicyError(f"{path}: not UTF-8") from None
        lines: yaml.Node | None = None
        try:
            if path.suffix == ".json":
                raw = json.loads(text)
            else:
                raw = yaml.safe_load(text)
                lines = yaml.compose(text, Loader=yaml.SafeLoader)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            kind = "JSON" if path.suffix == ".json" else "YAML"
            raise PolicyError(f"{path}: not valid {kind}: {exc}") from None
        return cls.from_mapping(raw, source=str(path), lines=lines)


def _line_of(root: yaml.Node | None, path: tuple[str | int, ...]) -> int | None:
    """The 1-based line of the deepest node along ``path`` (unknown parts are skipped,
    such as the type tags pydantic adds to locations)."""
    node, line = root, None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(part):
                    node, line = value_node, key_node.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(part, int)
            and 0 <= part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
    if line is None and root is not None:
        line = root.start_mark.line + 1
    return line


TYPE_TAGS = frozenset(
    {"string", "integer", "number", "boolean", "enum", "uuid", "timestamp", "list", "object"}
)


def _describe(source: str, problems: list[Problem], lines: yaml.Node | None) -> str:
    parts = []
    for path, message in problems:
        # pydantic puts the discriminating type tag into locations; readers never wrote it
        where = ".".join(str(p) for p in path if p not in TYPE_TAGS) or "<document>"
        line = _line_of(lines, path)
        parts.append(
            f"{source}:{line}: {where}: {message}" if line else f"{source}: {where}: {message}"
        )
    return "\n".join(parts)


MAX_BODY_DEPTH = 64  # a policy's types nest; deeper than any MAX_TYPE_DEPTH allows


def load_policy_versions(path: Path) -> list[Policy]:
    """Every policy of a file or folder, several versions of one name allowed (what
    ``ztate verify --policy`` reads: a ledger that spans a policy edit names each
    version by its digest). Versions with the same digest count once."""
    files = _policy_files(path) if path.is_dir() else [path]
    by_digest: dict[str, Policy] = {}
    for file in files:
        policy = Policy.load(file)
        by_digest.setdefault(policy.digest, policy)
    return list(by_digest.values())


def _policy_files(folder: Path) -> list[Path]:
    files = sorted(
        p for p in folder.iterdir() if p.suffix in {".yaml", ".yml", ".json"} and p.is_file()
    )
    if not files:
        raise PolicyError(f"{folder}: no policy files (.yaml, .yml, .json)")
    return files


class PolicySet:
    """All loaded policies; each node is registered in exactly one."""

    def __init__(self, policies: Iterable[Policy]) -> None:
        self.policies: dict[str, Policy] = {}
        self._by_node: dict[str, Policy] = {}
        for policy in policies:
            if policy.name in self.policies:
                raise PolicyError(f"two policies are named {policy.name!r}")
            self.policies[policy.name] = policy
            for node in policy.document.nodes:
                other = self._by_node.get(node)
                if other is not None:
                    raise PolicyError(
                        f"node {node!r} is registered in both {other.name!r} and "
                        f"{policy.name!r}; a node belongs to one policy"
                    )
                self._by_node[node] = policy
        if not self.policies:
            raise PolicyError("no policy loaded")

    def get(self, name: str) -> Policy | None:
        return self.policies.get(name)

    def of_node(self, node: str) -> Policy | None:
        return self._by_node.get(node)

    @property
    def only(self) -> Policy | None:
        """The policy, when exactly one is loaded."""
        return next(iter(self.policies.values())) if len(self.policies) == 1 else None

    @classmethod
    def load(cls, path: Path) -> PolicySet:
        """One policy file, or every .yaml/.yml/.json file of a folder."""
        if path.is_dir():
            return cls(Policy.load(p) for p in _policy_files(path))
        return cls([Policy.load(path)])
