"""``ztate completion bash|zsh|fish``: shell completion, generated from the parser itself.

bash and zsh come from shtab (it reads the argparse tree); fish, which shtab does not
write, from the same tree here: every command, subcommand and flag, with its help.
"""

from __future__ import annotations

import argparse

from ztate.services.cli.output import OK, write

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
SHELLS = ("bash", "zsh", "fish")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def fish(parser: argparse.ArgumentParser) -> str:
    """A fish completion script for ``parser``'s command tree."""
    lines = [
        "# fish completion for ztate (ztate completion fish > ~/.config/fish/completions/"
        "ztate.fish)",
        "complete -c ztate -f",
    ]

    def walk(node: argparse.ArgumentParser, path: list[str]) -> None:
        children = _subcommands(node)
        if path:
            condition = " ".join(f"__fish_seen_subcommand_from {p};" for p in path).rstrip(";")
            condition = " and ".join(condition.split("; "))
        else:
            condition = "__fish_use_subcommand"
        if children:
            seen = " ".join(children)
            guard = (
                f"{condition}; and not __fish_seen_subcommand_from {seen}" if path else condition
            )
            for name in children:
                described = _quote(_help_of(node, name))
                lines.append(f"complete -c ztate -n {_quote(guard)} -a {name} -d {described}")
        for action in node._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            if not action.option_strings:
                continue
            names = " ".join(
                f"-l {option[2:]}" if option.startswith("--") else f"-s {option[1:]}"
                for option in action.option_strings
            )
            takes = " -r" if action.nargs != 0 else ""
            choices = f" -a {_quote(' '.join(map(str, action.choices)))}" if action.choices else ""
            where = f" -n {_quote(condition)}" if path else ""
            described = _quote(action.help or "")
            lines.append(f"complete -c ztate{where} {names}{takes}{choices} -d {described}")
        for name, child in children.items():
            walk(child, [*path, name])

    walk(parser, [])
    return "\n".join(lines)


def cmd_completion(args: argparse.Namespace) -> int:
    from ztate.services.cli.main import build_parser

    parser = build_parser()
    if args.shell == "fish":
        write(fish(parser))
        return OK
    import shtab

    write(shtab.complete(parser, shell=args.shell).rstrip("\n"))
    return OK


def register(commands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``completion`` to the ``ztate`` command."""
    completion = commands.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh, fish)",
        description="bash: source <(ztate completion bash); zsh: ztate completion zsh > "
        '"${fpath[1]}/_ztate"; fish: ztate completion fish > '
        "~/.config/fish/completions/ztate.fish",
    )
    completion.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    completion.set_defaults(func=cmd_completion)
