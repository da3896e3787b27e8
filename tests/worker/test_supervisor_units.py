"""The host's supervisor with stand-in worker processes: which processes a `gpus` setting makes, their
environment, restarts with backoff and a limit, SIGTERM passed on, one /metrics and one /readyz.

The stand-in is a short Python program that serves /metrics and /readyz on the socket it inherits, as a
worker does, and exits as a file tells it to; the real worker under the supervisor is tested in
test_supervisor.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.broker import free_port
from worker.config import WorkerSettings
from worker.metrics import BOUNDED_LABELS
from worker.supervisor import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    Child,
    Restarts,
    Slot,
    Supervisor,
    child_environment,
    flags_as_environment,
    merge_expositions,
    plan_slots,
)

# A worker process in miniature: /metrics with one counter, /readyz ready; on SIGTERM it waits DRAIN_S
# (its "drain") and exits 0; a file named after its label, when present, makes it exit with that code.
# START_S is its start-up (a worker's imports) before it handles SIGTERM: LABEL.ready.PID marks the end.
STAND_IN = r"""
import http.server, os, pathlib, signal, socket, sys, threading, time
label = os.environ["SCORE_WORKER_LOG_TAG"]
control = pathlib.Path(os.environ["STAND_IN_DIR"])
# written under a hidden name, then renamed: the test reads a mark only once it holds its whole text
hidden = control / f".{label}.starting"
hidden.write_text(os.environ["SCORE_WORKER_GROUP_INSTANCE_ID"])
os.replace(hidden, control / f"{label}.pid.{os.getpid()}")
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            name = b"score_worker_requests_total"
            body = b"# HELP %s requests\n# TYPE %s counter\n" % (name, name)
            body += b'%s{worker="%s"} 7.0\n' % (name, os.environ["SCORE_WORKER_WORKER_ID"].encode())
            kind = "text/plain; version=0.0.4"
        else:
            body, kind = b'{"ready": true, "checks": {"model_loaded": true}}', "application/json"
        self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args): pass
# the socket the supervisor bound for it, as the worker serves it (worker/service.py)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
server.socket.close()
server.socket = socket.socket(fileno=int(os.environ["SCORE_WORKER_METRICS_FD"]))
assert server.socket.getsockname()[1] == int(os.environ["SCORE_WORKER_METRICS_PORT"])
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(float(os.environ.get("START_S", "0")))
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
(control / f"{label}.ready.{os.getpid()}").write_text("")
while not stop.wait(0.02):
    exit_file = control / f"{label}.exit"
    if exit_file.exists():
        code = int(exit_file.read_text()); exit_file.unlink(); sys.exit(code)
time.sleep(float(os.environ.get("DRAIN_S", "0.2")))
(control / f"{label}.drained.{os.getpid()}").write_text("")
sys.exit(0)
"""


def _settings(tmp_path: Path, **values: Any) -> WorkerSettings:
    defaults: dict[str, Any] = {
        "bootstrap_servers": "127.0.0.1:9",
        "model_dir": tmp_path,
        "worker_id": "host-a",
        "gpus": "2",
        "device": "cpu",
        "metrics_host": "127.0.0.1",
        "metrics_port": free_port(),
        "restart_backoff_ms": 50,
        "drain_timeout_ms": 5_000,
    }
    return WorkerSettings(**{**defaults, **values})


def _supervisor(
    tmp_path: Path, settings: WorkerSettings, drain_s: float = 0.2, start_s: float = 0.0
) -> Supervisor:
    slots = plan_slots(settings.gpus, settings.device, [])
    environ = {"PATH": "/usr/bin:/bin", "STAND_IN_DIR": str(tmp_path)}
    environ |= {"DRAIN_S": str(drain_s), "START_S": str(start_s)}
    environment = child_environment(settings, {}, len(slots), environ)
    return Supervisor(settings, slots, [sys.executable, "-c", STAND_IN], environment)


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def _until(check: Any, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _pids(tmp_path: Path, label: str) -> list[str]:
    return sorted(path.name.rsplit(".", 1)[1] for path in tmp_path.glob(f"{label}.pid.*"))


def _count(tmp_path: Path, pattern: str) -> int:
    """Marks the stand-ins left: LABEL.pid.PID at start, LABEL.drained.PID after a drain."""
    return len(list(tmp_path.glob(pattern)))


def _exit(tmp_path: Path, label: str, code: int) -> None:
    """Make the stand-in of `label` exit with `code`."""
    (tmp_path / f"{label}.exit").write_text(str(code))


def _members(tmp_path: Path, label: str) -> set[str]:
    """The static member ids the runs of `label` had."""
    return {path.read_text() for path in tmp_path.glob(f"{label}.pid.*")}


# -- which processes, and their environment -------------------------------------------------------------


def test_gpu_choices_make_one_process_per_gpu() -> None:
    visible = ["0", "1", "2", "3"]
    assert [s.label for s in plan_slots("all", "auto", visible)] == ["0", "1", "2", "3"]
    assert [s.label for s in plan_slots("2", "cuda", visible)] == ["0", "1"]
    assert plan_slots("1,3", "auto", visible) == [Slot("1", ("1",)), Slot("3", ("3",))]
    assert plan_slots("2,", "auto", visible) == [Slot("2", ("2",))]
    # CUDA_VISIBLE_DEVICES narrowed the host's GPUs: indices count within what is visible.
    assert plan_slots("1", "auto", ["GPU-aaaa", "GPU-bbbb"]) == [Slot("0", ("GPU-aaaa",))]
    assert plan_slots("3", "cpu", []) == [Slot("cpu0", ()), Slot("cpu1", ()), Slot("cpu2", ())]
    # Tensor-parallel groups of consecutive GPUs, each one worker process (the group's rank 0).
    assert plan_slots("all", "auto", visible, tensor_parallel=2) == [
        Slot("0-1", ("0", "1")),
        Slot("2-3", ("2", "3")),
    ]
    assert plan_slots("1,3", "cuda", visible, tensor_parallel=2) == [Slot("1-3", ("1", "3"))]
    assert plan_slots("all", "auto", visible, tensor_parallel=4)[0].suffix == "gpu0-1-2-3"


@pytest.mark.parametrize(
    ("choice", "device", "visible", "says"),
    [
        ("5", "auto", ["0", "1"], "5 GPUs asked for, 2 visible"),
        ("0,2", "auto", ["0", "1"], "GPU 2 asked for, 2 visible"),
        ("all", "auto", [], "no GPU is visible"),
        ("all", "cpu", [], "a count of CPU worker processes"),
        ("2", "cuda:1", ["0", "1"], "names one GPU"),
        ("3", "auto", ["0", "1", "2"], "do not form groups of tensor_parallel 2"),
    ],
)
def test_gpu_choices_that_cannot_be_met_say_why(
    choice: str, device: str, visible: list[str], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        plan_slots(choice, device, visible, tensor_parallel=2 if "groups" in says else 1)


@pytest.mark.parametrize(
    ("value", "says"), [("0", "count of 0"), ("1,1", "twice"), ("gpu0", "not a GPU choice")]
)
def test_gpu_settings_refused(tmp_path: Path, value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _settings(tmp_path, gpus=value)


def test_each_process_is_one_gpu_member_of_the_group(tmp_path: Path) -> None:
    settings = _settings(tmp_path, gpus="1,3", device="auto", group_instance_id="scorer-2")
    given = flags_as_environment(
        {"max_batch_tokens": "4096", "self_check": False, "gpus": "1,3", "group_id": None}
    )
    assert given == {
        "SCORE_WORKER_MAX_BATCH_TOKENS": "4096",
        "SCORE_WORKER_SELF_CHECK": "false",
        "SCORE_WORKER_GPUS": "1,3",
    }
    environment = child_environment(settings, given, 2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "HOME": "/root"})
    slot = plan_slots(settings.gpus, settings.device, ["4", "5", "6", "7"])[1]
    env = environment(Child(slot, Restarts(1, 1, 1), port=12345, listener=7))
    assert env["CUDA_VISIBLE_DEVICES"] == "7"  # the host's GPU 3 of those visible to it
    assert env["SCORE_WORKER_DEVICE"] == "cuda:0"
    assert env["SCORE_WORKER_GPUS"] == ""  # the process is one worker, not another host
    assert env["SCORE_WORKER_GROUP_INSTANCE_ID"] == "scorer-2-gpu3"  # the same after every restart
    assert env["SCORE_WORKER_WORKER_ID"] == "host-a-gpu3"
    assert (env["SCORE_WORKER_METRICS_HOST"], env["SCORE_WORKER_METRICS_PORT"]) == ("127.0.0.1", "12345")
    assert env["SCORE_WORKER_METRICS_FD"] == "7"  # the socket it inherits, bound to that port
    assert env["SCORE_WORKER_MAX_BATCH_TOKENS"] == "4096" and env["HOME"] == "/root"
    cpu = _settings(tmp_path, gpus="2")
    cpu_env = child_environment(cpu, {}, 2, {})(Child(Slot("cpu1", ()), Restarts(1, 1, 1)))
    assert cpu_env["SCORE_WORKER_DEVICE"] == "cpu"
    assert cpu_env["SCORE_WORKER_GROUP_INSTANCE_ID"] == "host-a-cpu1"  # no group_instance_id: the host's name
    assert int(cpu_env["OMP_NUM_THREADS"]) >= 1  # the cores shared out among the processes
    group = _settings(tmp_path, gpus="all", device="auto", tensor_parallel=2)
    group_env = child_environment(group, {}, 1, {})(Child(Slot("0-1", ("4", "5")), Restarts(1, 1, 1)))
    assert (group_env["CUDA_VISIBLE_DEVICES"], group_env["SCORE_WORKER_DEVICE"]) == (
        "4,5",
        "cuda",
    )  # rank r: cuda:r
    assert group_env["SCORE_WORKER_GROUP_INSTANCE_ID"] == "host-a-gpu0-1"


def test_restarts_back_off_and_stop_at_the_limit() -> None:
    now = [0.0]
    restarts = Restarts(limit=3, window_s=100, backoff_s=1, clock=lambda: now[0])
    assert [restarts.next_delay(), restarts.next_delay(), restarts.next_delay()] == [1, 2, 4]
    assert restarts.next_delay() is None  # a fourth within the window: the host gives up
    now[0] = 150.0  # the window has passed: the count starts again
    assert restarts.next_delay() == 1
    capped = Restarts(limit=20, window_s=1e9, backoff_s=1, clock=lambda: 0.0)
    assert max(capped.next_delay() or 0 for _ in range(20)) == 60  # never more than a minute


def test_expositions_merge_with_a_gpu_label() -> None:
    part = (
        "# HELP score_worker_requests_total requests\n# TYPE score_worker_requests_total counter\n"
        'score_worker_requests_total{{worker="w-{0}"}} {1}\n'
        "# HELP score_worker_batch_seconds batch\n# TYPE score_worker_batch_seconds histogram\n"
        'score_worker_batch_seconds_bucket{{le="1.0"}} {1}\n'
        'score_worker_batch_seconds_bucket{{le="+Inf"}} {1}\n'
        "score_worker_batch_seconds_count {1}\nscore_worker_batch_seconds_sum 0.5\n"
    )
    merged = merge_expositions([("0", part.format("gpu0", 3)), ("1", part.format("gpu1", 5))])
    families = {family.name: family for family in merged}
    assert families["score_worker_requests"].type == "counter"
    assert {(s.labels["gpu"], s.value) for s in families["score_worker_requests"].samples} == {
        ("0", 3),
        ("1", 5),
    }
    assert families["score_worker_batch_seconds"].type == "histogram"
    assert len(families["score_worker_batch_seconds"].samples) == 8


# -- the supervisor with stand-in processes --------------------------------------------------------------


def test_a_process_that_dies_is_restarted_with_the_same_member_id(tmp_path: Path) -> None:
    asyncio.run(_a_process_that_dies_is_restarted_with_the_same_member_id(tmp_path))


async def _a_process_that_dies_is_restarted_with_the_same_member_id(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    supervisor = _supervisor(tmp_path, settings)
    run = asyncio.create_task(supervisor.run())
    await _until(lambda: len(_pids(tmp_path, "cpu0")) == 1 and len(_pids(tmp_path, "cpu1")) == 1, 30, "start")
    _exit(tmp_path, "cpu1", 1)
    await _until(lambda: len(_pids(tmp_path, "cpu1")) == 2, 30, "the restart")
    assert len(_pids(tmp_path, "cpu0")) == 1  # its neighbour ran on undisturbed
    assert _members(tmp_path, "cpu1") == {"host-a-cpu1"}
    await _until(lambda: _count(tmp_path, "cpu1.ready.*") == 2, 10, "the restarted process")
    assert supervisor.children[1].restarted == 1
    supervisor.stop()
    assert await asyncio.wait_for(run, 30) == EXIT_OK
    assert _count(tmp_path, "*.drained.*") == 2  # both drained on SIGTERM


def test_sigterm_waits_for_every_process_to_drain(tmp_path: Path) -> None:
    asyncio.run(_sigterm_waits_for_every_process_to_drain(tmp_path))


async def _sigterm_waits_for_every_process_to_drain(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, _settings(tmp_path, gpus="3"), drain_s=1.5)
    run = asyncio.create_task(supervisor.run())
    await _until(lambda: all(child.running for child in supervisor.children), 30, "start")
    await _until(lambda: _count(tmp_path, "*.ready.*") == 3, 30, "the processes' start")
    started = asyncio.get_running_loop().time()
    supervisor.stop()
    assert await asyncio.wait_for(run, 30) == EXIT_OK
    assert asyncio.get_running_loop().time() - started >= 1.4  # it waited for their drain
    assert _count(tmp_path, "*.drained.*") == 3


def test_sigterm_during_start_up_is_a_clean_stop(tmp_path: Path) -> None:
    asyncio.run(_sigterm_during_start_up_is_a_clean_stop(tmp_path))


async def _sigterm_during_start_up_is_a_clean_stop(tmp_path: Path) -> None:
    """A process stopped while it still imports ends by the signal itself (-15): it had taken no request,
    so the host's exit is still a clean one."""
    supervisor = _supervisor(tmp_path, _settings(tmp_path), start_s=30)
    run = asyncio.create_task(supervisor.run())
    await _until(lambda: _count(tmp_path, "*.pid.*") == 2, 30, "the processes' start")
    supervisor.stop()
    assert await asyncio.wait_for(run, 20) == EXIT_OK
    assert _count(tmp_path, "*.ready.*") == 0  # both were stopped before their handler was there


def test_the_restart_limit_stops_the_host_with_a_failure(tmp_path: Path) -> None:
    asyncio.run(_the_restart_limit_stops_the_host_with_a_failure(tmp_path))


async def _the_restart_limit_stops_the_host_with_a_failure(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, _settings(tmp_path, restart_limit=2))
    run = asyncio.create_task(supervisor.run())
    for attempt in range(3):  # the first run and two restarts; the third failure is one too many
        await _until(lambda a=attempt: len(_pids(tmp_path, "cpu0")) == a + 1, 30, f"run {attempt + 1}")
        await _until(lambda: supervisor.children[0].running, 10, "the process")
        _exit(tmp_path, "cpu0", 3)
    assert await asyncio.wait_for(run, 30) == EXIT_FAILURE
    assert _count(tmp_path, "cpu1.drained.*") == 1  # the healthy one was drained, not killed


def test_a_process_that_cannot_start_is_not_restarted(tmp_path: Path) -> None:
    asyncio.run(_a_process_that_cannot_start_is_not_restarted(tmp_path))


async def _a_process_that_cannot_start_is_not_restarted(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, _settings(tmp_path))
    run = asyncio.create_task(supervisor.run())
    await _until(lambda: _count(tmp_path, "*.pid.*") == 2, 30, "start")
    _exit(tmp_path, "cpu0", EXIT_USAGE)  # its settings or model are wrong
    assert await asyncio.wait_for(run, 30) == EXIT_USAGE
    assert len(_pids(tmp_path, "cpu0")) == 1


def test_one_metrics_and_one_readiness_for_the_host(tmp_path: Path) -> None:
    asyncio.run(_one_metrics_and_one_readiness_for_the_host(tmp_path))


async def _one_metrics_and_one_readiness_for_the_host(tmp_path: Path) -> None:
    settings = _settings(tmp_path, restart_backoff_ms=60_000)  # a process that dies stays down here
    supervisor = _supervisor(tmp_path, settings)
    run = asyncio.create_task(supervisor.run())
    port = settings.metrics_port
    try:
        await _until(lambda: _count(tmp_path, "*.pid.*") == 2, 30, "start")

        def ready() -> bool:
            return _get(port, "/readyz")[0] == 200

        for _ in range(600):
            if await asyncio.to_thread(ready):
                break
            await asyncio.sleep(0.05)
        status, body = await asyncio.to_thread(_get, port, "/readyz")
        answer = json.loads(body)
        assert status == 200 and answer["checks"] == {"cpu0": True, "cpu1": True}
        assert set(answer["processes"]) == {"cpu0", "cpu1"}
        assert answer["processes"]["cpu0"]["checks"] == {"model_loaded": True}
        status, body = await asyncio.to_thread(_get, port, "/metrics")
        assert status == 200
        families = {family.name: family for family in text_string_to_metric_families(body.decode())}
        requests = {(s.labels["gpu"], s.labels["worker"]) for s in families["score_worker_requests"].samples}
        assert requests == {("cpu0", "host-a-cpu0"), ("cpu1", "host-a-cpu1")}
        up = {s.labels["gpu"]: s.value for s in families["score_worker_host_process_up"].samples}
        assert up == {"cpu0": 1.0, "cpu1": 1.0}
        assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
        _exit(tmp_path, "cpu1", 1)
        await _until(lambda: not supervisor.children[1].running, 10, "the exit")
        status, body = await asyncio.to_thread(_get, port, "/readyz")
        assert status == 503 and json.loads(body)["checks"] == {"cpu0": True, "cpu1": False}
        assert json.loads(body)["processes"]["cpu1"]["pid"] is None
    finally:
        supervisor.stop()
        assert await asyncio.wait_for(run, 30) == EXIT_OK


def test_run_with_gpus_where_none_is_visible_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code = main(["run", "--bootstrap-servers", "127.0.0.1:9", "--model", str(tmp_path), "--gpus", "all"])
    assert code == EXIT_USAGE
    assert "gpus 'all': no GPU is visible here" in capsys.readouterr().err


def test_a_process_port_listens_before_the_process_runs_a_line(tmp_path: Path) -> None:
    """The supervisor binds each process's metrics socket and hands it over: the port is the process's from
    its start, so a program that takes ports meanwhile cannot make it fail. A process that never binds
    anything still has its port listening (the kernel queues the connection), and a new one after each
    restart."""
    settings = _settings(tmp_path, gpus="1", restart_backoff_ms=0)
    slots = plan_slots(settings.gpus, settings.device, [])
    environment = child_environment(settings, {}, len(slots), {"PATH": "/usr/bin:/bin"})
    sleeper = "import time; time.sleep(60)"  # binds nothing
    supervisor = Supervisor(settings, slots, [sys.executable, "-c", sleeper], environment)

    async def scenario() -> None:
        run = asyncio.create_task(supervisor.run())
        try:
            child = supervisor.children[0]
            await _until(lambda: child.running, 30, "start")
            ports = [child.port]
            _, writer = await asyncio.open_connection("127.0.0.1", child.port)
            writer.close()
            assert child.process is not None
            child.process.kill()
            await _until(lambda: child.running and child.restarted == 1, 30, "a restart")
            ports.append(child.port)
            _, writer = await asyncio.open_connection("127.0.0.1", child.port)
            writer.close()
            assert all(ports)
        finally:
            supervisor.stop()
            supervisor.stop()  # the sleeper has no drain: the second stop ends it at once
            await asyncio.wait_for(run, 30)

    asyncio.run(scenario())


def test_host_series_carry_only_bounded_labels(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, _settings(tmp_path))
    for family in supervisor._registry.collect():
        for sample in family.samples:
            assert set(sample.labels) <= BOUNDED_LABELS, (family.name, sample.labels)
