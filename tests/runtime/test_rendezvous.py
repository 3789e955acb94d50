"""meshfit.runtime.rendezvous: the start-up handshake, over real sockets, each process of a job played by a thread.

The processes of a real job run it through `meshfit.runtime.cluster.initialize`; tests/test_cluster.py
starts such processes. Here the timeouts are seconds, so every way a job fails to form is quick.
"""

import json
import re
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from meshfit.launch.local import free_port
from meshfit.runtime import rendezvous
from meshfit.runtime.rendezvous import JoinError, JoinTimeoutError, assemble

pytestmark = pytest.mark.slow  # waits out real timeouts on real sockets (the fast tier leaves these out)


def start(address, count, process_id, timeout=10.0, notice_after=60.0, delay=0.0):
    """Runs `assemble` for one process in a thread; returns a dict that gets "error" (or None) and "took"."""
    outcome = {}

    def run():
        time.sleep(delay)
        began = time.monotonic()
        try:
            assemble(address, count, process_id, timeout, bind_address=address, notice_after=notice_after)
            outcome["error"] = None
        except Exception as error:  # noqa: BLE001 (the test looks at which)
            outcome["error"] = error
        outcome["took"] = time.monotonic() - began

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def finish(*outcomes, within=30.0):
    for outcome in outcomes:
        outcome["thread"].join(within)
        assert not outcome["thread"].is_alive(), "a process of the handshake did not finish"
    return [outcome["error"] for outcome in outcomes]


@pytest.fixture
def address():
    return f"127.0.0.1:{free_port()}"


def test_all_processes_meet_then_the_port_is_free_for_jax(address):
    outcomes = [start(address, 3, 2), start(address, 3, 1, delay=0.5), start(address, 3, 0, delay=1.0)]
    assert finish(*outcomes) == [None, None, None]
    assert max(o["took"] for o in outcomes) < 5
    host, port = rendezvous.split_address(address)
    with socket.create_server((host, port)):  # JAX's coordination service binds it next
        pass


def test_process_0_alone_says_what_it_waits_for_then_raises_with_the_count(address, capsys):
    (error,) = finish(start(address, 2, 0, timeout=2, notice_after=0.5))
    assert isinstance(error, JoinTimeoutError) and isinstance(error, TimeoutError)
    assert str(error).startswith(f"only 1 of 2 processes joined at {address} within 2 s (not joined: process 1). ")
    for cause in ("a process was not started", "a wrong process count", "a firewall"):
        assert cause in str(error)
    waiting = [line for line in capsys.readouterr().err.splitlines() if "waiting" in line]
    assert waiting == [f"meshfit: waiting for 2 processes at {address} (1 joined, timeout 2 s)"]


def test_a_process_that_finds_no_coordinator_says_so_within_the_timeout(address, capsys):
    (error,) = finish(start(address, 2, 1, timeout=2, notice_after=0.5))
    assert isinstance(error, JoinTimeoutError)
    message = str(error)
    assert message.startswith(f"the job did not assemble: 2 processes expected at {address} within 2 s. ")
    assert "(id 1 of 2 processes) got no answer" in message and "Connection refused" in message
    assert "process 0 was not started" in message
    assert f"meshfit: waiting for process 0, the coordinator, at {address}" in capsys.readouterr().err


def test_every_process_connected_gives_process_0s_count(address):
    """Process 1's own time ends first; it waits for process 0's verdict, so both say 2 of 3."""
    member = start(address, 3, 1, timeout=2)
    chief = start(address, 3, 0, timeout=2, delay=1.0)
    errors = finish(member, chief)
    for error in errors:
        assert isinstance(error, JoinTimeoutError)
        assert str(error).startswith(f"only 2 of 3 processes joined at {address} within 2 s (not joined: process 2)")


def test_two_processes_with_one_id_are_refused_in_every_process(address):
    outcomes = [start(address, 3, 0), start(address, 3, 1), start(address, 3, 1, delay=0.5)]
    errors = finish(*outcomes)
    for error in errors:
        assert isinstance(error, ValueError), error
        assert re.match(r"two processes were given process id 1: process 1 \(pid \d+ on .*\) and process 1", str(error))
        assert "from 0 to 2" in str(error)
    assert max(o["took"] for o in outcomes) < 5  # not the 10 s timeout


def test_two_processes_0_are_refused_in_both(address):
    first, second = start(address, 2, 0), start(address, 2, 0, delay=0.5)
    errors = finish(first, second)
    for error in errors:
        assert isinstance(error, ValueError), error
        assert str(error).startswith("two processes were given process id 0: process 0 (pid ")
    assert second["took"] < 5


def test_different_counts_are_refused(address):
    errors = finish(start(address, 2, 0), start(address, 3, 1, delay=0.3))
    for error in errors:
        assert isinstance(error, ValueError), error
        assert "was told the job has 3 processes, process 0 that it has 2" in str(error)


def test_process_0_going_away_ends_the_wait_of_the_others(address):
    """A process 0 that stops listening mid-wait (it failed) is noticed at once, not after the timeout."""
    host, port = rendezvous.split_address(address)
    member = start(address, 3, 1, timeout=10)
    with socket.create_server((host, port)) as listener:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b'{"joined": 2, "missing": [2]}\n')
        conn.close()
    (error,) = finish(member)
    assert isinstance(error, JoinError)
    assert "closed the connection before the job assembled (2 of 3 processes had joined)" in str(error)
    assert member["took"] < 5


def test_a_process_that_left_is_no_longer_counted(address):
    """Process 1 joins and dies: process 0 reports 1 of 3, not 2 of 3 joined."""
    host, port = rendezvous.split_address(address)
    chief = start(address, 3, 0, timeout=3)
    time.sleep(0.5)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b'{"protocol": "meshfit-join/1", "id": 1, "processes": 3, "host": "h", "pid": 1}\n')
        assert json.loads(sock.recv(4096)) == {"joined": 2, "missing": [2]}
    (error,) = finish(chief)
    assert isinstance(error, JoinTimeoutError)
    assert str(error).startswith(f"only 1 of 3 processes joined at {address} within 3 s (not joined: process 1, 2)")


def test_a_port_held_by_another_program_is_named(address):
    host, port = rendezvous.split_address(address)
    with socket.create_server((host, port)):
        errors = finish(start(address, 2, 0, timeout=2), start(address, 2, 1, timeout=1))
    assert isinstance(errors[0], JoinError)
    in_use = f"process 0 cannot listen on port {port} for the job's coordinator, which is in use: Address already"
    assert str(errors[0]).startswith(in_use)
    assert "Another program, or an earlier job still running, holds it" in str(errors[0])
    assert isinstance(errors[1], JoinTimeoutError)  # the other program never answers process 1
    assert str(errors[1]).startswith(f"the job did not assemble: 2 processes expected at {address} within 1 s")


def test_something_else_answering_on_the_port_is_not_taken_for_process_0(address):
    host, port = rendezvous.split_address(address)
    with socket.create_server((host, port)) as other:
        member = start(address, 2, 1)
        conn, _ = other.accept()
        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame, as gRPC sends
        (error,) = finish(member)
        conn.close()
    assert isinstance(error, JoinError)
    assert str(error).startswith(f"something other than meshfit's start-up answers at {address}")


def test_stray_connections_do_not_count(address):
    host, port = rendezvous.split_address(address)
    chief = start(address, 2, 0, timeout=5)
    time.sleep(0.5)
    with socket.create_connection((host, port)) as stray:
        stray.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # a gRPC client of another job
        assert stray.recv(4096) == b""  # process 0 drops it
    member = start(address, 2, 1)
    assert finish(chief, member) == [None, None]


CHIEF = """
import resource, sys
from meshfit.runtime.rendezvous import assemble
assemble(sys.argv[1], 2, 0, 60.0, bind_address=sys.argv[1])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"cpu {usage.ru_utime + usage.ru_stime:.3f}", flush=True)
"""


@pytest.mark.processes
def test_process_0_out_of_file_descriptors_backs_off_says_so_and_the_job_still_forms(address):
    """`ulimit -n 64` in process 0 and 160 idle connections: accept() fails for lack of descriptors while
    connections wait. Process 0 must not spin (its CPU time stays low), must say why it cannot accept, and
    the real process 1 must still join."""
    limit, idle = 64, 160
    chief = subprocess.Popen(
        [sys.executable, "-c", CHIEF, address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
    )
    host, port = rendezvous.split_address(address)
    strangers = []
    try:
        give_up = time.monotonic() + 30
        while not strangers and time.monotonic() < give_up:  # until process 0 listens
            try:
                strangers.append(socket.create_connection((host, port), timeout=2))
            except OSError:
                time.sleep(0.1)
        for _ in range(idle - 1):
            try:
                strangers.append(socket.create_connection((host, port), timeout=2))
            except OSError:  # the backlog is full: the kernel drops what is past it
                pass
        time.sleep(3.0)  # process 0 out of descriptors, connections waiting: where it used to spin
        member = start(address, 2, 1, timeout=40)
        (error,) = finish(member, within=60)
        out, err = chief.communicate(timeout=30)
    finally:
        for sock in strangers:
            sock.close()
        if chief.poll() is None:
            chief.kill()
            chief.wait()
    assert error is None and chief.returncode == 0, err
    assert member["took"] < 10, member["took"]  # silent connections were closed to make room, not waited out
    cpu = float(re.search(r"cpu ([\d.]+)", out).group(1))
    assert cpu < 2.0, f"process 0 used {cpu} s of CPU while out of descriptors (a spinning accept loop)"
    shortage = [line for line in err.splitlines() if "out of file descriptors" in line]
    assert len(shortage) == 1, err
    assert f"limit {limit}, hard limit {limit}" in shortage[0] and "Raise the limit (`ulimit -n`" in shortage[0]
