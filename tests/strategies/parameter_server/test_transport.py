"""transport: the control connections' handshake is bounded on both sides, over real sockets."""

import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

import numpy as np
import pytest

from meshfit.launch.local import free_port
from meshfit.strategies.parameter_server import launcher, transport

KEY = b"k" * 32


@pytest.fixture
def job_address(monkeypatch):
    """The `MESHFIT_PS_*` variables of a job whose coordinator would listen on a free port."""
    port = free_port()
    monkeypatch.setenv(launcher.ENV_PS_ADDRESS, f"127.0.0.1:{port}")
    monkeypatch.setenv(launcher.ENV_PS_AUTHKEY, KEY.hex())
    return "127.0.0.1", port


def serve_one(address, key, then=None):
    """A coordinator's side for one connection, in a thread: accepts, runs the handshake, returns what came."""
    listener = Listener(address)
    outcome = {}

    def run():
        conn = listener.accept()
        try:
            outcome["result"] = transport.handshake(conn, key, accepting=True, timeout=2.0, then=then)
        except transport.HANDSHAKE_ERRORS as error:
            outcome["error"] = error
        conn.close()
        listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_the_job_s_own_processes_connect_and_talk(job_address):
    thread, outcome = serve_one(job_address, KEY, then=lambda conn: conn.recv())
    channel = transport.connect(timeout=10)
    channel.send(("hello", "worker", None, 1))
    thread.join(10)
    assert outcome == {"result": ("hello", "worker", None, 1)}
    channel.close()


def test_a_silent_peer_is_dropped_within_the_bound(job_address):
    thread, outcome = serve_one(job_address, KEY)
    began = time.monotonic()
    with socket.create_connection(job_address):  # connects, says nothing
        thread.join(10)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], EOFError)
    assert time.monotonic() - began < 5  # the 2 s bound, not forever


def test_a_peer_without_the_secret_is_refused(job_address):
    thread, outcome = serve_one(job_address, KEY)
    with pytest.raises(AuthenticationError):
        Client(job_address, authkey=b"another job's key")
    thread.join(10)
    assert isinstance(outcome["error"], AuthenticationError)


def test_connecting_with_another_job_s_secret_says_so_at_once(job_address):
    thread, _ = serve_one(job_address, b"another job's key")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="rejected this process's secret \\(MESHFIT_PS_AUTHKEY\\)"):
        transport.connect(timeout=30)
    assert time.monotonic() - began < 5  # not retried for 30 s
    thread.join(10)


def test_connecting_to_a_port_that_never_answers_gives_up_in_time(job_address):
    """Something holds the coordinator's port, accepts and says nothing: connect() ends with a clear error."""
    with socket.create_server(job_address) as holder:
        began = time.monotonic()
        with pytest.raises(
            TimeoutError, match=f"no parameter-server coordinator answered at 127.0.0.1:{job_address[1]} "
        ):
            transport.connect(timeout=1.5)
        assert time.monotonic() - began < 4
        holder.close()


def test_a_gate_admits_the_job_s_processes_past_strangers_that_hold_its_port(job_address, capfd):
    """What every server's listener is (rank 0's for workers and servers, the others' for workers): silent,
    garbage and wrong-secret connections, still open or in their handshake, hold up no process of the job."""
    admitted = []
    gate = transport.Gate(("127.0.0.1", 0), KEY, lambda channel, hello: admitted.append((channel, hello)))
    where = transport.parse_address(gate.address)
    silent = [socket.create_connection(where) for _ in range(3)]
    with socket.create_connection(where) as garbage:
        garbage.sendall(b"\x7f\xff\xff\xff" + b"x" * 1000)
    with pytest.raises(AuthenticationError):
        Client(where, authkey=b"another job's key")
    began = time.monotonic()
    channel = transport.connect(timeout=10, where=where, what="server (rank 1)")
    channel.send(("hello", "worker", None, 1234))
    while not admitted and time.monotonic() - began < 5:
        time.sleep(0.01)
    assert [hello for _, hello in admitted] == [("hello", "worker", None, 1234)]
    assert time.monotonic() - began < 2  # not after the strangers' 10 s bound
    admitted[0][0].send(("part", 1, transport.to_wire([np.array([[1.0, 2.0]], np.float32)])))
    _, job, items = channel.recv(timeout=5, silent=TimeoutError)
    assert job == 1 and transport.from_wire(items)[0].tolist() == [[1.0, 2.0]]
    for sock in silent:
        sock.close()
    gate.close()
    said = f"closed a connection to {gate.address} that did not complete"
    err = capfd.readouterr().err
    while said not in err and time.monotonic() - began < 5:  # the wrong secret's thread prints it
        time.sleep(0.05)
        err += capfd.readouterr().err
    assert err.count(said) == 1, err  # once, for the first stranger only


def test_a_send_to_a_peer_that_reads_nothing_fails_after_the_bound():
    """A stopped worker reads nothing: a send larger than the sockets' buffers fails with an OSError once the
    bound passes (rank 0 then drops the worker) instead of blocking for ever, and a heartbeat does not queue
    behind it."""
    listener = Listener(("127.0.0.1", 0))
    reader = Client(listener.address)  # never reads
    channel = transport.Channel(listener.accept())
    transport.bound_sends(channel, 0.5)
    pinged = {}
    work = ("work", np.zeros(96 * 2**20, np.uint8).tobytes())  # past loopback's buffers (tens of MiB)

    def heartbeat():  # once the large send is under way (its first bytes arrived), while it blocks
        while not reader.poll(0.01):
            pass
        pinged["sent"] = channel.send_if_idle(("ping",))

    beat = threading.Thread(target=heartbeat)
    beat.start()
    started = time.monotonic()
    with pytest.raises(OSError):
        channel.send(work)
    took = time.monotonic() - started
    beat.join()
    assert 0.4 < took < 20, took
    assert pinged["sent"] is False
    for end in (reader, channel, listener):
        end.close()
