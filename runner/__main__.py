"""``python -m agentfast.runner`` is the ``agentfast`` CLI."""

from .cli import main

main()
