"""Weight sync of a model of a few hundred MB: copy at attach, upload, convert, download and load.

    python benchmarks/weight_sync.py [--mb 400] [--candidate paddle|torch] [--compression auto|zstd]

The server runs in a process of its own (``twinstep serve``), the torch baseline
in this one (``share_weights=True``) and the candidate in a child process
(``init_from_baseline=True``), all over loopback.  The model is a stack of
square 2048 x 2048 float32 Linear layers (16 MiB each): every weight is
transposed on the way to paddle.  Prints the baseline's copy at attach and
upload, then (started once the upload is done) the candidate's request-to-loaded
time, with throughputs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDTH = 2048

CANDIDATE = textwrap.dedent("""
    import os, sys, time
    layers, framework, server, compression = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    if framework == "paddle":
        import paddle
        model = paddle.nn.Sequential(*[paddle.nn.Linear({w}, {w}) for _ in range(layers)])
    else:
        import torch
        model = torch.nn.Sequential(*[torch.nn.Linear({w}, {w}) for _ in range(layers)])
    import twinstep
    started = time.monotonic()
    mon = twinstep.attach(model, session="bench", run=framework + "-cand", server=server, init_from_baseline=True,
                          init_timeout=600, compression=compression)
    sync = mon.weight_sync
    print(f"RESULT {{sync.bytes}} {{sync.seconds:.3f}} {{time.monotonic() - started:.3f}}", flush=True)
    mon.close()
""").format(w=WIDTH)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python benchmarks/weight_sync.py --mb 400 --candidate paddle")
    p.add_argument("--mb", type=int, default=400, help="model size in MiB (rounded to 16 MiB layers)")
    p.add_argument("--candidate", choices=("paddle", "torch"), default="paddle")
    p.add_argument("--compression", choices=("auto", "zstd", "none"), default="auto")
    args = p.parse_args()
    layers = max(1, args.mb // 16)

    server = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--port", "0"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = None
    for line in server.stdout:
        found = re.search(r"listening on (\S+)", line)
        if found:
            address = found.group(1)
            break
    if address is None:
        raise SystemExit("twinstep serve did not start")
    try:
        import torch

        import twinstep

        torch.set_num_threads(1)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        started = time.monotonic()
        mon = twinstep.attach(model, session="bench", run="torch", baseline=True, server=address, share_weights=True,
                              compression=args.compression)
        attached = time.monotonic() - started
        publisher = mon._weights
        publisher.done.wait(600)
        uploaded = time.monotonic() - started
        # After the upload: the candidate's figure is its own download, conversion and load.
        candidate = subprocess.Popen([sys.executable, "-c", CANDIDATE, str(layers), args.candidate, address,
                                      args.compression], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        out = candidate.communicate(timeout=900)[0]
        found = re.search(r"RESULT (\d+) ([\d.]+) ([\d.]+)", out)
        mon.close()
        mib = nbytes / 2**20
        print(f"model: {layers} x Linear({WIDTH}, {WIDTH}) float32, {mib:.0f} MiB; candidate {args.candidate}, "
              f"compression {args.compression}")
        print(f"baseline: attach {attached:.2f} s (of which the copy {publisher.copy_seconds:.2f} s, "
              f"{mib / publisher.copy_seconds:.0f} MiB/s); upload done {uploaded - attached:.2f} s after attach "
              f"returned ({mib / (uploaded - attached):.0f} MiB/s)")
        if found:
            sent, seconds, total = int(found.group(1)), float(found.group(2)), float(found.group(3))
            print(f"candidate: weight sync {seconds:.2f} s from its request to loaded, attach {total:.2f} s "
                  f"({sent / 2**20 / seconds:.0f} MiB/s: request, conversion on the server, transfer and load)")
        else:
            print("candidate failed:\n" + out[-2000:])
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
