"""Direct-path Redis users: one ACL user per tenant, confined to its key prefix, rotated.

The gateway stays the control plane of the SWA direct path (docs/SWA_POOL.md,
"Direct path"): a client asks it (SwaPool.OpenDirect) and gets a Redis user
that can touch only `<key_prefix><tenant tag>:*` with only the commands a
snapshot reader (GET, EXISTS, PTTL, PING) or writer (also SET, SETRANGE, RENAME) needs. Nothing
else: no KEYS, SCAN, FLUSH*, CONFIG, ACL, DEL, pub/sub channels.

Rotation rules (tests: tests/gateway/test_swa_direct.py):
1. A user lives `lifetime_s` from its creation; then it is deleted (ACL DELUSER,
   which also closes the connections authenticated as it).
2. From half its lifetime on, a grant hands out a new user with a new random
   password; the old one keeps working until its own lifetime ends (the grace:
   half a lifetime), so a client re-opening at half-life never sees a refusal.
3. Users a previous gateway left behind (name prefix `kvstore-swa-`) are deleted
   once their lifetime has ended: ACL users live in the Redis process, not in the
   gateway. A user's name ends with the Unix second its lifetime ends (wall clock),
   so any gateway of the Redis can tell: the sweep, at the first grant and then every
   half lifetime, deletes only the users past it (and names without one: an older
   kvstore's). In a fleet many nodes share one Redis Cluster (docs/FLEET.md F46): a
   node's sweep must not delete the live users of the others, nor leave a dead node's
   users living for good.

All methods block on Redis: the pool calls them on its own threads.
"""

from __future__ import annotations

import math
import secrets
import threading
from typing import Any

from kvstore.clock import Clock
from tiers.swa_pool import DirectUser

#: Name prefix of every direct-path user (so one gateway can find and delete its users).
USER_PREFIX = "kvstore-swa-"
READ_COMMANDS = ("+get", "+exists", "+pttl", "+ping")
#: What a Redis Cluster client runs to find the nodes and the keys of commands (read-only facts).
CLUSTER_COMMANDS = ("+cluster|slots", "+cluster|shards", "+cluster|nodes", "+command", "+readonly")
#: A writer streams each record to a temporary key of its own under a placeholder header, writes the
#: real header over it and renames it to the snapshot's key (SET, SETRANGE, RENAME:
#: kvstore.client.swa_direct). Each names keys only, held to the user's key pattern (RENAME both).
WRITE_COMMANDS = ("+set", "+setrange", "+rename")


class AclUsers:
    """The direct-path users of one Redis, per (tenant tag, writable), with their rotation.

    Args:
        command: runs one Redis command (on every node, for a cluster) and returns its answer.
        lifetime_s: how long a user lives (rule 1).
        clock: its monotonic face times lifetimes.
    """

    def __init__(self, command: Any, *, lifetime_s: float, clock: Clock, cluster: bool = False) -> None:
        self._command = command
        self.cluster = cluster
        self.lifetime_s = lifetime_s
        self.clock = clock
        self._current: dict[tuple[str, bool], DirectUser] = {}
        self._retiring: list[DirectUser] = []
        self._swept_at: float | None = None
        self._lock = threading.Lock()

    def grant(self, tag: str, key_pattern: bytes, *, writable: bool) -> DirectUser:
        """The user to hand out for tenant `tag` now (rule 2), created or re-applied in Redis.

        The user is set again on every grant (ACL SETUSER ... reset is idempotent),
        so a Redis restarted since the user was made (it forgets users) has it back.
        """
        with self._lock:
            now = self.clock.monotonic()
            self._sweep_if_due(now)
            self._reap(now)
            slot = (tag, writable)
            user = self._current.get(slot)
            if user is None or now >= user.created_s + self.lifetime_s / 2:
                if user is not None:
                    self._retiring.append(user)
                ends = math.ceil(self.clock.now() + self.lifetime_s)  # rule 3: in the name, for any gateway
                user = DirectUser(username=f"{USER_PREFIX}{tag}-{secrets.token_hex(4)}-{ends}",
                                  password=secrets.token_hex(32), writable=writable, created_s=now,
                                  expires_s=now + self.lifetime_s)
                self._current[slot] = user
            commands = READ_COMMANDS + (WRITE_COMMANDS if writable else ()) + (CLUSTER_COMMANDS if self.cluster else ())
            self._command("ACL", "SETUSER", user.username, "reset", "on", f">{user.password}",
                          b"~" + key_pattern, "resetchannels", "-@all", *commands)
            return user

    def reap(self) -> int:
        """Delete every user past its lifetime (rule 1), and sweep others' when due (rule 3); how many of
        this gateway's went."""
        with self._lock:
            now = self.clock.monotonic()
            if self._swept_at is not None:  # from the first grant on: a gateway never asked for users sweeps none
                self._sweep_if_due(now)
            return self._reap(now)

    def _reap(self, now: float) -> int:
        gone = [u for u in self._retiring if u.expires_s <= now]
        gone += [u for u in self._current.values() if u.expires_s <= now]
        if not gone:
            return 0
        self._command("ACL", "DELUSER", *(u.username for u in gone))
        names = {u.username for u in gone}
        self._retiring = [u for u in self._retiring if u.username not in names]
        self._current = {k: u for k, u in self._current.items() if u.username not in names}
        return len(gone)

    def _sweep_if_due(self, now: float) -> None:
        """Rule 3: delete the users past their lifetime that any gateway of this Redis left, at the first
        grant and then every half lifetime."""
        if self._swept_at is not None and now < self._swept_at + self.lifetime_s / 2:
            return
        listed = self._command("ACL", "USERS")
        if isinstance(listed, dict):  # a cluster: each node's list
            listed = {n for per_node in listed.values() for n in per_node or ()}
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in listed or ()]
        wall = self.clock.now()
        left = [n for n in names if n.startswith(USER_PREFIX) and _ends_s(n) <= wall]
        if left:
            self._command("ACL", "DELUSER", *sorted(left))
        self._swept_at = now

    def delete_all(self) -> None:
        """Delete every user this gateway made (at close)."""
        with self._lock:
            users = [*self._retiring, *self._current.values()]
            if users:
                self._command("ACL", "DELUSER", *(u.username for u in users))
            self._retiring, self._current = [], {}


def _ends_s(username: str) -> float:
    """The Unix second a direct-path user's lifetime ends, from its name (rule 3); 0 for a name without one
    (an older kvstore's `kvstore-swa-<tag>-<hex>`, whose last part is not a time: deleted as before)."""
    tail = username.rsplit("-", 1)[-1]
    return float(tail) if tail.isdigit() and len(tail) >= 10 else 0.0
