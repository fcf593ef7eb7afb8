"""``python -m bench``: run the benchmark suite (see ``bench/__init__.py``)."""

from bench.run import main

raise SystemExit(main())
