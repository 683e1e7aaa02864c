"""Most recently used eviction, shipped as a third-party plug-in (test fixture).

MRU suits looping scans larger than the cache; here it mostly proves that a
policy from another package shows up in ``expertcache policies`` and runs.
The class is exposed through the entry point, so it is not decorated with
``@register``: the registry registers entry-point classes itself.
"""

from collections import OrderedDict

from expertcache import EvictionPolicy


class MostRecentlyUsed(EvictionPolicy):
    name = "plugin-mru"
    description = "most recently used (test plug-in from tests/plugin_pkg)"

    def __init__(self, capacity, **params):
        super().__init__(capacity)
        self._order = OrderedDict()  # oldest first

    def on_insert(self, key, now):
        self._order[key] = None

    def on_access(self, key, now):
        self._order.move_to_end(key)

    def on_remove(self, key):
        del self._order[key]

    def victim(self, protected):
        for key in reversed(self._order):
            if key not in protected:
                return key
        return None
