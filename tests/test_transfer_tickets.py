"""Ticket tensors (``zinf_runtime.transfer``): made a block at a time, each with its own storage and
handed out once, each read back to its own pending transfer; waiting twice, or as another link, still
raises by name. (The dp-2 bucket tests run them through torch's custom-op alias check.)"""

from __future__ import annotations

import pytest
import torch

from zinf_runtime import transfer
from zinf_runtime.transfer import Ticket, TransferEngine


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 tickets, so a few starts cross block boundaries."""
    tickets = transfer._TicketTensors()
    monkeypatch.setattr(tickets, "BLOCK", 4)
    monkeypatch.setattr(transfer, "_TICKETS", tickets)
    return tickets


def test_each_ticket_resolves_to_its_own_transfer_across_blocks(small_blocks):
    eng = TransferEngine("t")
    tokens = [eng.start(Ticket("h2d", f"p{i}", 8, lambda i=i: i)) for i in range(11)]  # 3 blocks
    ids = [int(t.item()) for t in tokens]
    assert ids == sorted(set(ids)), ids  # distinct, in start order
    # each its own storage: a custom op's outputs may not alias each other (zinf.gather_bucket
    # returns several tickets) or its inputs (zinf.upload takes a ticket and returns one)
    assert len({t.untyped_storage().data_ptr() for t in tokens}) == len(tokens)
    assert all(t.dtype == torch.int64 and t.numel() == 1 and t.device.type == "cpu" for t in tokens)
    assert eng.in_flight == 11
    for i in reversed(range(11)):  # any order of waits
        assert transfer.finish(transfer.take(tokens[i], "h2d")) == i
    assert eng.in_flight == 0


def test_a_dead_tickets_memory_reused_by_a_compiler_changes_no_later_ticket(small_blocks):
    eng = TransferEngine("t")
    first = eng.start(Ticket("h2d", "a", 8, lambda: "a"))
    transfer.finish(transfer.take(first, "h2d"))
    first.fill_(-7)  # Inductor may write a later buffer into a dead fallback result's memory
    later = [eng.start(Ticket("h2d", f"b{i}", 8, lambda i=i: i)) for i in range(6)]
    assert [transfer.finish(transfer.take(t, "h2d")) for t in later] == list(range(6))


def test_waiting_twice_or_as_another_link_raises(small_blocks):
    eng = TransferEngine("t")
    token = eng.start(Ticket("all_gather", "w", 8, lambda: None))
    with pytest.raises(RuntimeError, match="is a all_gather transfer, waited for as h2d"):
        transfer.take(token, "h2d")
    token = eng.start(Ticket("all_gather", "w", 8, lambda: None))
    transfer.take(token, "all_gather")
    with pytest.raises(RuntimeError, match="unknown or already waited for"):
        transfer.take(token, "all_gather")
