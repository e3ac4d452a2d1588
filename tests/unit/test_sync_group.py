"""The weight-sync broadcast group is formed and tested at set-up: its first collective runs in
the constructor (NCCL would otherwise build its communicator lazily, at the end of step 1), and
a group that cannot form fails with one error naming the backend, ranks, store and timeout. The
gloo group here is the NCCL path's code on CPU tensors."""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from pjray.placement import free_address
from pjray.sync.collective import SyncStalled, WeightSyncGroup


def _form(backend: str, **kw) -> dict[int, WeightSyncGroup]:
    """Two members joining at once (each in a thread; with NCCL on GPU `rank`), as the learner
    and an engine do; the groups by rank."""
    _, port = free_address()
    groups: dict[int, WeightSyncGroup] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            groups[rank] = WeightSyncGroup("127.0.0.1", port, rank, 2, backend, **kw)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and sorted(groups) == [0, 1]
    return groups


def test_two_members_form_the_group_and_broadcast():
    groups = _form("gloo", timeout_s=60)
    sent, received = torch.arange(5.0), torch.zeros(5)
    threads = [
        threading.Thread(target=groups[0].broadcast, args=(sent,)),
        threading.Thread(target=groups[1].broadcast, args=(received,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.equal(received, sent)
    for group in groups.values():
        group.close()


def _one_never_joins(backend: str) -> dict[int, BaseException]:
    """Three members, ranks 0 and 1 joining (with NCCL each on its GPU), rank 2 never: what each
    raised, by rank; both must have raised within 30 s."""
    _, port = free_address()
    names = ("learner rank 0", "rollout worker 0", "rollout worker 1")
    errors: dict[int, BaseException] = {}

    def join(rank: int) -> None:
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            WeightSyncGroup("127.0.0.1", port, rank, 3, backend, timeout_s=600, join_s=2, members=names)
        except BaseException as err:  # noqa: BLE001 - checked below
            errors[rank] = err

    start = time.monotonic()
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert time.monotonic() - start < 30 and sorted(errors) == [0, 1]
    assert re.search(
        rf"weight-sync group \({backend}, rank 0 of 3, store 127\.0\.0\.1:{port}, timeout 600s\): never joined "
        r"within 2s: rollout worker 1 \(rank 2\)$",
        str(errors[0]),
    ), errors[0]
    assert "rank 1 of 3" in str(errors[1])
    assert "learner rank 0 (rank 0) did not see every member join" in str(errors[1])
    return errors


def test_a_member_that_never_joins_is_named_by_rank_0_and_the_others_fail_out_too():
    """One member never joins: rank 0 fails within `join_s` naming it (and the group's address),
    and the member that did join fails out at the same bound, instead of both waiting in the
    backend's rendezvous for its timeout (600 s here)."""
    _one_never_joins("gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_nccl_group_names_a_member_that_never_joins():
    """The same on NCCL, whose first collective (which builds the communicator) would otherwise
    wait for the missing member with no bound at all."""
    _one_never_joins("nccl")


def test_a_member_whose_rank_0_never_comes_fails_naming_its_store():
    _, port = free_address()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2, store .*: could not reach the store of rank 0 within 1s"):
        WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", join_s=1)


def test_a_reserved_port_is_kept_from_other_binds_and_open_to_the_store_it_is_for():
    """A rendezvous port probed and released could be taken before rank 0 binds it, seconds
    later (EADDRINUSE in a busy CI). `free_address` keeps it bound: no bind to port 0 gets it,
    a plain bind to it fails, and a TCPStore in another process still listens on it."""
    _, port = free_address()
    others = []
    for _ in range(2000):
        sock = socket.socket()
        sock.bind(("", 0))
        others.append(sock)
    handed_out = {s.getsockname()[1] for s in others}
    for sock in others:
        sock.close()
    assert port not in handed_out
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("", port))
    assert refused.value.errno == errno.EADDRINUSE
    store = (
        "import datetime, torch.distributed as dist\n"
        f"s = dist.TCPStore('127.0.0.1', {port}, 1, is_master=True, timeout=datetime.timedelta(seconds=10))\n"
        "s.set('k', 'v'); print(s.get('k').decode())\n"
    )
    done = subprocess.run([sys.executable, "-c", store], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "v", done.stderr[-2000:]


def test_a_broadcast_whose_sender_never_sends_stalls_out_and_tears_the_group_down():
    """A receiver waiting on a member that takes no part (an engine or learner that died): the
    broadcast fails after the group's bounded wait, naming itself, instead of returning "done"
    (NCCL) or blocking for the backend's 600 s timeout, and the group is gone."""
    groups = _form("gloo", timeout_s=600, wait_s=1.5)
    start = time.monotonic()
    with pytest.raises(SyncStalled, match=r"rank 1 of 2.*did not complete within 1.5s"):
        groups[1].broadcast(torch.zeros(4), src=0)  # member 0 never sends
    assert 1.4 < time.monotonic() - start < 30
    assert groups[1].group is None
    groups[0].close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_nccl_receive_whose_sender_never_sends_stalls_out_instead_of_reporting_done():
    """The NCCL case the bounded wait is for: `wait()` on a receive whose sender never sends
    returns at once (it only orders the stream), so without the poll the member would report a
    finished sync with a hung stream. The receiver raises `SyncStalled` and aborts its
    communicator; the sender's side then forms nothing more."""
    groups = _form("nccl", timeout_s=120, wait_s=3.0)
    torch.cuda.set_device(1)
    start = time.monotonic()
    with pytest.raises(SyncStalled, match=r"nccl, rank 1 of 2.*did not complete within 3s"):
        groups[1].broadcast(torch.zeros(1024, device="cuda:1"), src=0)
    assert time.monotonic() - start < 60 and groups[1].group is None
    groups[0].abort()
