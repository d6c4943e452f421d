"""``python -m flashcl``: the same command as ``flashcl``."""

from .cli import main

main()
