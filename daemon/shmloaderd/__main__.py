"""Entry point of ``shmloaderd``."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("shmloaderd is not built yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
