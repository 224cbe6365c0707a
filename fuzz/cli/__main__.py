"""``python -m kvfuzz.fuzz.cli``: the kvfuzz command."""

from kvfuzz.fuzz.cli import main

main()
