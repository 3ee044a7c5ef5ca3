"""Costs that must follow what is live now, not how much has happened before.

A plain dict that loses its first key again and again keeps dummies at the front of its entries, and
every look at its oldest (``next(iter(d))``) walks them until the dict next resizes: a bounded book that
evicts its oldest that way costs more per operation once it has been full for a while, which a short
benchmark never sees. The books read oldest-first are ordered dicts, whose oldest is one step away.
"""

from __future__ import annotations

import ast
from collections import OrderedDict
from pathlib import Path

from mmfeat.daemon.leases.sessions import MAX_CUT_REMEMBERED, MAX_PENDING_SESSIONS, PeerCred, SessionTable

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("client", "daemon", "protos", "mmfeat_pkg")


def _oldest_first_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of each ``next(iter(self.X))`` or ``next(iter(self.X.items()/keys()/values()))``."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next"
                and node.args and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Name) and node.args[0].func.id == "iter"
                and node.args[0].args):
            continue
        target = node.args[0].args[0]
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) \
                and target.func.attr in ("items", "keys", "values"):
            target = target.func.value
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            found.append((node.lineno, target.attr))
    return found


def _starts_as_plain_dict(tree: ast.AST, attr: str) -> bool:
    """Whether some ``self.<attr> = {}`` (annotated or not) makes the attribute an empty plain dict."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        plain = (isinstance(value, ast.Dict) and not value.keys) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict")
        if plain and any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
            return True
    return False


def _evicts_first_key(node: ast.AST) -> bool:
    """``del d[next(iter(d))]`` or ``d.pop(next(iter(d)))``: the eviction that walks the dummies."""
    def is_first_key(expr: ast.AST) -> bool:
        return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "next"
                and bool(expr.args) and isinstance(expr.args[0], ast.Call)
                and isinstance(expr.args[0].func, ast.Name) and expr.args[0].func.id == "iter")

    if isinstance(node, ast.Delete):
        return any(isinstance(t, ast.Subscript) and is_first_key(t.slice) for t in node.targets)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop"
            and bool(node.args) and is_first_key(node.args[0]))


def test_no_book_that_starts_empty_is_read_or_evicted_oldest_first_as_a_plain_dict() -> None:
    """Every bounded or oldest-first book in the tree (the daemon's waiting sessions, cut sessions and
    handshakes; the client's unconfirmed acks and abandoned calls) reaches its oldest in O(1)."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(ROOT)
            offenders += [f"{where}:{n.lineno}: evicts its oldest through next(iter())"
                          for n in ast.walk(tree) if _evicts_first_key(n)]
            offenders += [f"{where}:{line}: reads self.{attr}'s oldest, and self.{attr} is a plain dict"
                          for line, attr in _oldest_first_reads(tree) if _starts_as_plain_dict(tree, attr)]
    assert not offenders, "use an OrderedDict and popitem(last=False):\n" + "\n".join(offenders)


def test_the_session_table_far_past_its_bounds_keeps_its_books_bounded_and_ordered() -> None:
    """A hello flood five times the waiting bound, and cuts twenty times the remembered bound: both
    books hold at most their bound, the oldest went first, and each is an ordered dict, so the 20,000th
    hello drops its oldest as cheaply as the first one did."""
    table = SessionTable()
    attached, _ = table.open("kept", 1, now=0.0)
    table.attach(attached.token, PeerCred(1, 0, 0))
    opened = [table.open("flood", 2, now=1.0 + i)[0] for i in range(5 * MAX_PENDING_SESSIONS)]
    assert table.pending_count() == MAX_PENDING_SESSIONS and table.attached_count() == 1
    assert table.get(opened[-MAX_PENDING_SESSIONS - 1].token) is None
    assert table.get(opened[-MAX_PENDING_SESSIONS].token) is opened[-MAX_PENDING_SESSIONS]
    tokens = [table.open("cut", 3, now=1e9)[0].token for _ in range(20 * MAX_CUT_REMEMBERED)]
    for token in tokens:
        table.cut(token)
    assert len(table._cut) == MAX_CUT_REMEMBERED
    assert not table.was_cut(tokens[-MAX_CUT_REMEMBERED - 1]) and table.was_cut(tokens[-MAX_CUT_REMEMBERED])
    assert isinstance(table._pending, OrderedDict) and isinstance(table._cut, OrderedDict)
    # The grace expiry drops the waiting sessions created before its cutoff, oldest first, and no other.
    late = [table.open("late", 4, now=2e9 + i)[0] for i in range(100)]
    assert table.drop_unattached_before(cutoff=2e9 + 50) == 50 and table.get(late[50].token) is late[50]
    assert table.pending_count() == 50 and table.get(attached.token) is attached
