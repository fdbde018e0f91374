"""What the dashboard costs the server while it ingests: records/s compared with no page, with a real
Chromium page open on a loaded session, and with many pollers hammering its JSON view.

    python benchmarks/dashboard_cost.py [--seconds 15] [--records 500] [--ranks 2] [--pollers 20]

One ``twinstep serve --http-port 0`` process; the load is server_load.py's (pre-serialized steps sent
as fast as credit allows, from a client process), on fresh sessions per phase.  Each phase reports the
records compared per second, per server core (the server's own CPU time over the window, every
thread), the server's RSS, and for the phases with pages the view requests answered and their
latency.  The page polls once a second; views are cached per session and rebuilt at most once a
second (twinstep.server.view.service), so pollers should cost little beyond the first.
Without /usr/bin/chromium the browser phase is skipped.  The machine may be small and shared: the
figures are provisional.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import server_load as load  # noqa: E402  (the load generator and /proc readers of the server benchmark)

import grpc  # noqa: E402

from twinstep.v1 import twinstep_pb2_grpc as pb_grpc  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def start_server(log: str) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    address = url = None
    for line in proc.stdout:
        found = re.search(r"listening on (\S+)", line)
        address = found.group(1) if found else address
        found = re.search(r"^dashboard: (\S+)", line)
        if found:
            url = found.group(1)
            break
    if not (address and url):
        raise RuntimeError(f"the server did not start; see {log}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, address, url


def browser(url: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.get(url)
    return driver


def phase(name: str, proc: subprocess.Popen, address: str, args: argparse.Namespace, prefix: str,
          pages=None) -> dict:
    """Load fresh sessions for warm-up + args.seconds; ``pages(sessions, stop)`` runs beside the load."""
    sessions = [f"{prefix}{i}" for i in range(args.sessions)]
    acked = mp.Array("q", [-1] * (len(sessions) * 2 * args.ranks), lock=False)
    ready = mp.Barrier(2)
    warmup = 3.0
    stop_at = time.time() + args.seconds + warmup + 3.0
    client = mp.get_context("fork").Process(target=load._client_process, daemon=True, args=(
        address, sessions, args.ranks, args.records, False, stop_at, acked, 0, ready))
    client.start()
    ready.wait(timeout=60)
    stop = threading.Event()
    answered: list[float] = []
    worker = None
    if pages is not None:
        worker = threading.Thread(target=pages, args=(sessions, stop, answered), daemon=True)
        worker.start()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TwinstepStub(channel)
        time.sleep(warmup)
        answered.clear()
        t0, cpu0, c0 = time.perf_counter(), load._proc_cpu(proc.pid), load._compared(stub, sessions)
        time.sleep(args.seconds)
        t1, cpu1, c1 = time.perf_counter(), load._proc_cpu(proc.pid), load._compared(stub, sessions)
    stop.set()
    if worker is not None:
        worker.join(30)
    client.join(timeout=30)
    dt = t1 - t0
    busy = (cpu1 - cpu0) / dt
    records = (c1 - c0) * args.ranks * args.records / dt
    timed = [t for t in answered if t == t]
    row = {"phase": name, "records/s": records, "per core": records / max(busy, 1e-9), "cores": busy,
           "rss MB": load._proc_status(proc.pid)["VmRSS"] / 1024, "views": len(answered),
           "view p50 ms": 1e3 * statistics.median(timed) if timed else None}
    views = f"  {len(answered)} views" if answered else ""
    if timed:
        views += f", p50 {row['view p50 ms']:.1f} ms"
    print(f"  {name:<28} {records:>10,.0f} records/s  {row['per core']:>10,.0f} per core  {busy:4.2f} cores  "
          f"RSS {row['rss MB']:5.0f} MB{views}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--pollers", type=int, default=20, help="threads polling the JSON view every 0.25 s")
    args = parser.parse_args()
    log = os.path.join(tempfile.gettempdir(), f"twinstep_dashboard_cost_{os.getpid()}.log")
    proc, address, url = start_server(log)
    print(f"twinstep dashboard cost; {os.cpu_count()} CPUs; {args.sessions} sessions x {args.ranks} ranks x "
          f"{args.records} records/step; {args.seconds:g} s per phase; server log {log}")
    try:
        phase("no page", proc, address, args, "plain")

        if os.path.exists(CHROMIUM):
            def page(sessions, stop, answered):
                driver = browser(f"{url}sessions/{sessions[0]}")
                try:
                    seen = None
                    while not stop.wait(0.2):  # count the views the page rendered (each a fresh GET)
                        stamp = driver.execute_script("var v = window.twinstepDashboard.view;"
                                                      "return v ? v.generated_unix : null")
                        if stamp is not None and stamp != seen:
                            seen = stamp
                            answered.append(float("nan"))  # rendered: its latency is the page's own
                finally:
                    driver.quit()

            phase("one Chromium page", proc, address, args, "page", page)

        def pollers(sessions, stop, answered):
            def poll():
                while not stop.is_set():
                    started = time.perf_counter()
                    with urllib.request.urlopen(f"{url}api/sessions/{sessions[0]}/view", timeout=30) as response:
                        response.read()
                    answered.append(time.perf_counter() - started)
                    stop.wait(0.25)

            threads = [threading.Thread(target=poll, daemon=True) for _ in range(args.pollers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        phase(f"{args.pollers} pollers at 4/s", proc, address, args, "poll", pollers)
    finally:
        load._stop_server(proc)


if __name__ == "__main__":
    main()
