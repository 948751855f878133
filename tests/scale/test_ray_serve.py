"""Two replicas of the real default model on a local Ray instance, driven through Serve's HTTP proxy on loopback.

One Ray instance and one Serve application serve the whole module (replicas take seconds to start on a 2-core
CPU), so the tests run in file order: the fixed two-replica deployment first (chat and SSE through the proxy,
spread, a client disconnect, the metrics Ray aggregates and the Grafana dashboard read through Prometheus, a
killed replica), then the same application updated to autoscaling (down to one replica, then 1 -> 2 -> 1 under a
burst of slow streams), then a clean shutdown.
Replicas import this checkout's code (``PYTHONPATH`` in the job's runtime env).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from server.ray_app import REPLICA_HEADER, build_app  # noqa: E402
from tests.deploy import promql  # noqa: E402
from tests.deploy.conftest import DASHBOARD_FILE  # noqa: E402
from tests.deploy.test_prometheus_integration import Process, query, start, stop, wait_for  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
APP = "lookahead"
MODEL = "SmolLM2-135M-Instruct"
# measure_step_cost off: a replica's start skips the CPU preset's ~5 s calibration (decoding/calibration.py, tested
# on its own), which under the autoscaling test's burst took longer still
OVERRIDES = {"max_running": 2, "max_queue": 4, "default_max_tokens": 16, "drain_grace_seconds": 5, "threads": 1,
             "lookahead": {"memory_tokens": 0}, "batch": {"measure_step_cost": False}}
REPLICA_CPUS = 0.5  # four replicas fit in num_cpus=2 while an update replaces two with one
METRICS_INTERVAL_S = 0.5
PLAIN = {"lookahead": {"enabled": False}}  # one token per step: more, evenly spaced chunks
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_args(**options) -> dict:
    return {"overrides": OVERRIDES, "num_cpus": REPLICA_CPUS,
            "metrics_interval_s": METRICS_INTERVAL_S, "health_check_period_s": 1.0, **options}


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def replica_states() -> dict[str, int]:
    """Replicas of the app's deployment by state (Serve's own status): RUNNING, STARTING, STOPPING, ..."""
    application = serve.status().applications.get(APP)
    if application is None or not application.deployments:
        return {}
    states = next(iter(application.deployments.values())).replica_states
    return {state: count for state, count in states.items() if count}


def running_replicas() -> int:
    """Replicas of the app's deployment in state RUNNING."""
    return replica_states().get("RUNNING", 0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    """A local Ray instance (2 CPUs, loopback) with Serve's proxy on a free port; shut down cleanly at the end."""
    metrics_port, http_port = free_port(), free_port()
    # Ray turns a node IP of 127.0.0.1 into the machine's reachable address unless clusters are off, which is what
    # this variable (named for Windows and macOS, read on every platform) does: every Ray server on loopback. Ray
    # reads it when imported, so the already imported driver gets the same through its constant; the processes
    # Ray starts read the variable.
    previous = os.environ.get(SINGLE_NODE_ENV)
    os.environ[SINGLE_NODE_ENV] = "0"
    ray_constants = pytest.importorskip("ray._private.ray_constants")
    cluster_default, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    ray.init(
        num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _metrics_export_port=metrics_port,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, _system_config={"metrics_report_interval_ms": 500},
        logging_level="warning", log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield {"url": f"http://127.0.0.1:{http_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        serve.shutdown()
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = cluster_default
        if previous is None:
            os.environ.pop(SINGLE_NODE_ENV, None)
        else:
            os.environ[SINGLE_NODE_ENV] = previous


@pytest.fixture(scope="module")
def two_replicas(cluster) -> dict:
    """The app with a fixed two replicas, both warm."""
    started = time.monotonic()
    serve.run(build_app(app_args(num_replicas=2)), name=APP, route_prefix="/", blocking=False)
    wait_until(lambda: running_replicas() == 2, 240, "two running replicas")
    cluster["startup_s"] = time.monotonic() - started
    return cluster


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(prompt: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}


def test_ray_listens_on_loopback_only(two_replicas):
    """Ray's servers (GCS, raylet, workers, agents, Serve's proxy and controller) listen on loopback only. The one
    exception is Ray Serve's own: each replica's inter-deployment gRPC server binds ``[::]:0``, hard-coded in
    Ray Serve 2.60 (``ray/serve/_private/replica.py``), so replica processes are left out of the check; nothing
    in this module connects to it."""
    assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"]
    psutil = pytest.importorskip("psutil")
    try:
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid]
    except psutil.AccessDenied:
        pytest.skip("listening sockets of other processes are not visible to this user")
    names = {proc.pid: proc.info["name"] or "" for proc in psutil.process_iter(["name"])}
    ray_pids = {pid for pid, name in names.items() if name.startswith(("ray::", "raylet", "gcs_server"))
                and not name.startswith("ray::ServeRepli")}
    exposed = [(c.pid, c.laddr) for c in listening if c.pid in ray_pids and not loopback(c.laddr.ip)]
    assert ray_pids and exposed == []


def loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, an IPv4-mapped IPv6 address included (``::ffff:127.0.0.1``)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_chat_and_incremental_stream_through_the_proxy(two_replicas):
    sdk = client(two_replicas["url"])
    answer = sdk.chat.completions.create(**chat("What is the capital of France?", max_tokens=8))
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert (httpx.get(f"{two_replicas['url']}/health").json()) == {"status": "ok"}

    started = time.monotonic()
    arrivals, pieces, finish = [], [], None
    for chunk in sdk.chat.completions.create(**chat("Count from one to twenty.", max_tokens=24), stream=True,
                                             extra_body=PLAIN):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish in ("stop", "length") and len(pieces) >= 5
    # incremental: each chunk arrives when its decoding step ends (one token a step here, several ms apart even on a
    # fast machine), not in one burst at the end, where the gaps would be the microseconds of parsing a buffer
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(arrivals))
    assert gaps[len(gaps) // 2] > 0.002, arrivals


def test_requests_spread_over_both_replicas(two_replicas):
    async def one(http: httpx.AsyncClient, index: int) -> str:
        body = chat(f"Say the number {index}.", max_tokens=4)
        response = await http.post(f"{two_replicas['url']}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.headers[REPLICA_HEADER]

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, index) for index in range(8)))

    # the router chooses between two replicas at random when both look idle: eight in a row to one happens
    # (1 in 128), three bursts in a row to one does not
    seen = []
    while len(seen) < 3 and not any(len(replicas) == 2 for replicas in seen):
        seen.append(set(asyncio.run(burst())))
    assert len(seen[-1]) == 2, seen


def replica_metrics(url: str, replica: str) -> dict[str, float]:
    """One replica's own ``/metrics``, asked through the proxy until that replica answers (the proxy prefers the
    less busy replica, so ask while it is idle)."""

    def ask():
        response = httpx.get(f"{url}/metrics")
        return response if response.headers[REPLICA_HEADER] == replica else None

    return parse(wait_until(ask, 30, f"/metrics from {replica}", interval=0.05).text)


def parse(text: str, prefix: str = "") -> dict[str, float]:
    """``name{labels}`` -> value for samples whose name starts with ``prefix``."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def test_a_client_disconnect_mid_stream_cancels_its_generation(two_replicas):
    url = two_replicas["url"]
    own = {}
    while len(own) < 2:  # both replicas' counters before the stream
        response = httpx.get(f"{url}/metrics")
        own[response.headers[REPLICA_HEADER]] = parse(response.text)
    body = chat("Write a long story about a dragon.", max_tokens=200, stream=True, **PLAIN)
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        replica = response.headers[REPLICA_HEADER]
        before = own[replica]
        data = (line for line in response.iter_lines() if line.startswith("data:"))
        next(data), next(data)  # the role chunk and the first text: the generation is under way
    left = time.monotonic()

    def cancelled():
        samples = replica_metrics(url, replica)
        return samples if samples['lookahead_requests_total{finish_reason="abort"}'] > before[
            'lookahead_requests_total{finish_reason="abort"}'] else None

    samples = wait_until(cancelled, 20, "the abort on the stream's replica")
    assert time.monotonic() - left < 20  # far sooner than 200 tokens would take
    assert samples["lookahead_client_disconnects_total{}"] == before["lookahead_client_disconnects_total{}"] + 1
    assert samples["lookahead_requests_running{}"] == 0
    assert samples["lookahead_generation_tokens_total{}"] - before["lookahead_generation_tokens_total{}"] < 200


def test_ray_metrics_aggregate_every_replica(two_replicas):
    """``/metrics`` through the proxy is one replica's; Ray's export has every replica's, tagged."""
    url = two_replicas["url"]
    own = {}
    while len(own) < 2:
        response = httpx.get(f"{url}/metrics")
        own[response.headers[REPLICA_HEADER]] = parse(response.text)
    expected = sum(samples["lookahead_generation_tokens_total{}"] for samples in own.values())

    def aggregated():
        exported = parse(httpx.get(two_replicas["metrics"]).text, "ray_lookahead_generation_tokens_total")
        per_replica = {key: value for key, value in exported.items() if 'application="lookahead"' in key}
        return per_replica if len(per_replica) == 2 and sum(per_replica.values()) == expected else None

    per_replica = wait_until(aggregated, 30, "Ray's export to match the replicas' own counters", interval=0.5)
    assert len({key.split("replica=")[1] for key in per_replica}) == 2
    exported = parse(httpx.get(two_replicas["metrics"]).text, "ray_lookahead_kv_cache_usage_ratio")
    assert len(exported) >= 2


def prometheus_for_ray(metrics_url: str, directory: Path) -> tuple[Process, str]:
    """The real ``prometheus`` binary scraping Ray's export every second with docker/ray/prometheus.yml's
    relabelling (only the target replaced); returns the process and its base URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus binary not found (apt-get install -y prometheus)")
    config = yaml.safe_load((ROOT / "docker" / "ray" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    job.pop("file_sd_configs")
    job["static_configs"] = [{"targets": [metrics_url.split("//")[1].split("/")[0]]}]
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    return start("prometheus", command, directory / "prometheus.log"), f"http://127.0.0.1:{port}"


def test_the_dashboard_reads_a_ray_deployment(two_replicas, tmp_path):
    """Every dashboard query, through Prometheus scraping Ray's export with the relabelling, returns data, and the
    totals are sums over both replicas."""
    process, base = prometheus_for_ray(two_replicas["metrics"], tmp_path)
    try:
        wait_for("Prometheus /-/ready", lambda: httpx.get(f"{base}/-/ready", timeout=5).status_code == 200, 30,
                 process)
        total = 'sum(lookahead_generation_tokens_total{job="lookahead-server"})'
        wait_for("two scrapes of both replicas", lambda: len(query(base, "count by (replica) "
                 "(count_over_time(lookahead_requests_running[1m]) >= 2)")) == 2, 60, process)
        assert float(query(base, total)[0]["value"][1]) > 0
        dashboard = json.loads(DASHBOARD_FILE.read_text())
        empty = [f"{owner}: {expr}" for owner, expr in promql.dashboard_queries(dashboard)
                 if not query(base, promql.substitute_grafana_variables(expr))]
        assert empty == []
    finally:
        stop(process)


def replica_pids() -> dict[str, int]:
    """Replica id -> process id, asked through a deployment handle until both replicas answered."""
    handle = serve.get_app_handle(APP)
    found: dict[str, int] = {}
    deadline = time.monotonic() + 30
    while len(found) < 2 and time.monotonic() < deadline:
        info = handle.replica_info.remote().result(timeout_s=30)
        found[info["replica"]] = info["pid"]
    assert len(found) == 2, found
    return found


def test_a_killed_replica_loses_only_its_own_requests_and_comes_back(two_replicas):
    """Streams open one at a time, each waited for until its first chunk, until both replicas hold some (the router
    may send several in a row to one replica: CI once saw six of six on one); then one replica is killed."""
    url = two_replicas["url"]
    pids = replica_pids()
    results: dict[int, tuple[str, str]] = {}  # index -> (replica, outcome)
    placed: dict[int, str] = {}  # index -> replica, known once the stream has its first chunk

    def stream(index: int, started: threading.Event) -> None:
        body = chat(f"Tell me about the number {index}.", max_tokens=40, stream=True, **PLAIN)
        replica, events = "?", []
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
                replica = response.headers.get(REPLICA_HEADER, "?")
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        placed[index] = replica
                        started.set()
        except httpx.HTTPError:
            pass
        finally:
            started.set()
        done = len(events) >= 2 and events[-1] == "data: [DONE]" and '"error"' not in events[-2]
        results[index] = (replica, "done" if done else "lost")

    threads = []
    for index in range(16):
        started = threading.Event()
        threads.append(threading.Thread(target=stream, args=(index, started)))
        threads[-1].start()
        assert started.wait(120)
        if index >= 5 and set(placed.values()) >= set(pids):
            break
    assert set(placed.values()) >= set(pids), placed  # 16 streams, all on one replica: the router does not spread
    victim = next(iter(placed.values()))
    os.kill(pids[victim], signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    survivors = [outcome for replica, outcome in results.values() if replica != victim]
    assert survivors and all(outcome == "done" for outcome in survivors), results
    after = [client(url).chat.completions.create(**chat("Say hi.", max_tokens=4)) for _ in range(4)]
    assert all(answer.choices[0].finish_reason in ("stop", "length") for answer in after)
    wait_until(lambda: running_replicas() == 2, 240, "the replacement replica")
    assert victim not in replica_pids()


def test_autoscaling_goes_from_one_replica_to_two_and_back(cluster):
    autoscaling = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0, "upscale_delay_s": 0.5,
                   "downscale_delay_s": 3.0}
    serve.run(build_app(app_args(min_replicas=1, max_replicas=2, initial_replicas=1, autoscaling=autoscaling)),
              name=APP, route_prefix="/", blocking=False)
    wait_until(lambda: running_replicas() == 1 and serve.status().applications[APP].status == "RUNNING", 240,
               "one replica after the update")
    timeline = [(0.0, 1)]
    started = time.monotonic()
    stop = threading.Event()

    def slow_stream(index: int) -> None:
        body = chat(f"Write a poem about the sea, number {index}.", max_tokens=96, stream=True, **PLAIN)
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{cluster['url']}/v1/chat/completions", json=body, timeout=120) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break
            except httpx.HTTPError:
                time.sleep(0.2)

    threads = [threading.Thread(target=slow_stream, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: replica_states().get("STARTING", 0) + running_replicas() >= 2, 60,
                   "Serve deciding on a second replica", interval=0.1)
        decided = time.monotonic() - started
        wait_until(lambda: running_replicas() == 2, 180, "a second replica under the burst", interval=0.1)
        timeline.append((time.monotonic() - started, 2))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    idle = time.monotonic()
    wait_until(lambda: replica_states() == {"RUNNING": 1}, 120, "back to one replica when idle", interval=0.1)
    timeline.append((time.monotonic() - started, 1))
    print(f"\nautoscaling: second replica decided at {decided:.1f} s, running at {timeline[1][0]:.1f} s; "
          f"burst stopped at {idle - started:.1f} s, one replica again at {timeline[2][0]:.1f} s")
    assert [replicas for _, replicas in timeline] == [1, 2, 1]


def test_serve_shuts_down_cleanly(cluster):
    serve.delete(APP)
    wait_until(lambda: APP not in serve.status().applications, 60, "the application deleted")
    serve.shutdown()

    def serve_actors() -> list:
        return [actor for actor in ray.util.list_named_actors(all_namespaces=True) if "SERVE" in actor["name"]]

    wait_until(lambda: not serve_actors(), 60, "no Serve actor left")
