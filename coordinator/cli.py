"""offloadctl: placeholder until the demo is written."""


def main() -> int:
    return 0
