"""``python -m xfam.cli`` is the ``xfam`` command."""

from xfam.cli.main import main

main()
