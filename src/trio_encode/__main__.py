"""``python -m trio_encode``: the ``trio-encode`` command, for when its script is not on PATH."""

from trio_encode.cli import main

main()
