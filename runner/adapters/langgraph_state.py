"""What the LangGraph adapter's committed ``sdk_state`` names, readable without LangGraph.

The adapter's own format (``agentfast.langgraph-saver/2``, see ``langgraph.py``'s
``SnapshotSaver``): the store never interprets it (G8); a fork (``Store.fork_run``) asks
:func:`state_row_refs` which rows of ``agentfast_sdk_blobs`` a checkpoint's state names, so it
copies exactly those. No LangGraph import here: the operator registers forks too.
"""

from __future__ import annotations

from typing import Any

SDK_STATE_FORMAT = "agentfast.langgraph-saver/2"


def item_key(seq: int) -> str:
    """The row key of the elements appended from list element ``seq`` on: fixed width, so the
    rows of consecutive elements are a key range."""
    return f"i{seq:012d}"


def state_row_refs(state: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """The rows an exported ``sdk_state`` names, as ``(keys, ranges)`` for ``Store.sdk_rows``:
    each channel value's key, each pending write's key, and per list channel the key ranges of
    its element rows. Empty for an empty state or format /1 (everything inline)."""
    keys: list[str] = []
    ranges: list[tuple[str, str]] = []
    if not state or state.get("format") != SDK_STATE_FORMAT:
        return keys, ranges
    for entry in state["namespaces"].values():
        for ref in entry["channels"].values():
            if "key" in ref:
                keys.append(ref["key"])
            elif "items" in ref:
                # A range starts where a row of elements starts (ranges are cut at their end only).
                ranges += [(item_key(lo), item_key(hi)) for lo, hi in ref["items"]]
        keys += [w[3] for w in entry["writes"]]
    return keys, ranges
