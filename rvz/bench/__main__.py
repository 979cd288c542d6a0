"""``python -m rvz.bench``: the same as the ``rvz-bench`` console script."""

from .cli import main

raise SystemExit(main())
