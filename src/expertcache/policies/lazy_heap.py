"""The victim search shared by heap-ordered policies (lfu, belady).

Such a policy keeps ``entry[key]`` = the key's current heap item (a tuple whose last
field is the key) and pushes a new item on every change instead of updating in place;
items that no longer equal ``entry[key]`` are stale garbage.
"""

from __future__ import annotations

import heapq


def lowest_live(heap: list[tuple], entry: dict, protected) -> int | None:
    """Key of the smallest live item not in ``protected``, or None.

    Popping stale items is garbage collection, not a change of answer, so callers'
    ``victim()`` stays a pure query. Protected live items popped on the way are pushed back.
    """
    while heap and entry.get(heap[0][-1]) != heap[0]:
        heapq.heappop(heap)
    if not heap:
        return None
    if heap[0][-1] not in protected:
        return heap[0][-1]
    # Rare: the best key is needed by this step; look deeper, then put back.
    held, found = [], None
    while heap:
        item = heapq.heappop(heap)
        if entry.get(item[-1]) != item:
            continue
        held.append(item)
        if item[-1] not in protected:
            found = item[-1]
            break
    for item in held:
        heapq.heappush(heap, item)
    return found
