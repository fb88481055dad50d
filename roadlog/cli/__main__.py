"""``python -m roadlog.cli``."""

from roadlog.cli import main

main()
