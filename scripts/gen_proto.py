"""Regenerate the protobuf/gRPC modules of proto/ (committed, checked by a test).

Run `python scripts/gen_proto.py` after editing a .proto file; `--check` exits 1
when the committed modules differ from what the .proto files generate.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every .proto under proto/ into out_dir; return the files written."""
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Generated files whose committed copy differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
        stale = []
        for path in fresh:
            rel = path.relative_to(tmp)
            committed = PROTO_ROOT / rel
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(str(rel))
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: proto/{name}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(PROTO_ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
