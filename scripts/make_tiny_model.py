"""Write the tiny default Qwen2.5-VL checkpoint and print its folder."""

from __future__ import annotations

import argparse

from shared.tiny_checkpoint import ensure_tiny_checkpoint, write_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write a fresh copy into this folder instead of the cache")
    args = parser.parse_args()
    path = write_tiny_checkpoint(args.out) if args.out else ensure_tiny_checkpoint()
    print(path)


if __name__ == "__main__":
    main()
