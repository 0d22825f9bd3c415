"""A local copy of one etcd key range, kept current by a watch that resumes from the last revision it saw.

One range read at start, then only the changes: an idle range costs etcd nothing. When the watch stream
breaks (etcd restarted, a network blip) it is re-created from the revision after the last one applied, so
no change is missed; if etcd compacted that history away, the range is read again whole.
"""

from __future__ import annotations

import functools
import logging
import threading

from launcher.etcd import client as etcd_client
from launcher.etcd.entry import Entry

logger = logging.getLogger(__name__)

_RESUME_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class RangeMirror:
    """Every key under `prefix` with its value and mod revision; `wait` returns when something changed."""

    def __init__(self, client, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.revision = 0  # the newest etcd revision applied
        self.connected = False
        self._entries: dict[str, Entry] = {}
        self._version = 0  # bumped on every change, so a reader knows whether to look again
        # Protects _entries, revision, connected and _version; re-entrant so a signal handler may poke().
        self._changed = threading.Condition(threading.RLock())
        self._watch_id = None
        # each watch request gets the next generation; only an error of the newest one's stream means the mirror
        # lost its watch (an older stream's end is already dealt with)
        self._generation = 0
        self._resuming = False
        self._closed = False

    def start(self, deadline_s: float = 30.0) -> RangeMirror:
        etcd_client.call_with_retry(self._load_and_watch, deadline_s=deadline_s)
        return self

    def close(self) -> None:
        with self._changed:
            self._closed, self.connected = True, False
            watch_id, self._watch_id = self._watch_id, None
            self._changed.notify_all()
        if watch_id is not None:
            # the client queues a cancel request for its stream thread, and blocks when a dead stream's queue is
            # full: an agent must be able to exit whatever state the stream is in
            canceller = threading.Thread(target=self._cancel, args=(watch_id,), name="watch-cancel", daemon=True)
            canceller.start()
            canceller.join(timeout=1.0)

    def _cancel(self, watch_id) -> None:
        try:
            self.client.cancel_watch(watch_id)
        except Exception as exc:  # the stream may already be gone; nothing is left to cancel then
            logger.debug("cancelling watch on %s: %s", self.prefix, exc)

    def snapshot(self) -> tuple[dict[str, Entry], int, int]:
        """(entries by key relative to the prefix, revision, version), consistent with each other."""
        with self._changed:
            return dict(self._entries), self.revision, self._version

    @property
    def version(self) -> int:
        return self._version

    def wait(self, seen_version: int, timeout: float | None) -> int:
        """Block until the version moves past `seen_version` or `timeout` passes; returns the version."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != seen_version or self._closed, timeout)
            return self._version

    def poke(self) -> None:
        """Wake every waiter without a change (a signal arrived, a local deadline moved)."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    # -- etcd side -------------------------------------------------------------------------------------------
    def _load_and_watch(self) -> None:
        kvs, revision = self.client.read_prefix(self.prefix)
        entries = {kv.key.decode()[len(self.prefix) :]: Entry(kv.value, kv.mod_revision) for kv in kvs}
        with self._changed:
            self._entries, self.revision = entries, revision
            self._bump()
        self._watch()

    def _watch(self) -> None:
        with self._changed:
            self._generation += 1
            generation = self._generation
        watch_id = self.client.add_watch_prefix_callback(
            self.prefix, functools.partial(self._on_response, generation), start_revision=self.revision + 1
        )
        with self._changed:
            closed_meanwhile = self._closed
            # its stream may have failed before etcd's confirmation reached us: then _lost_stream has taken over
            if not closed_meanwhile and generation == self._generation:
                self._watch_id, self.connected = watch_id, True
                self._bump()
        if closed_meanwhile:
            self.client.cancel_watch(watch_id)

    def _on_response(self, generation: int, response) -> None:
        """Runs on the client's watch thread: apply the changes, or start resuming after an error."""
        if response is None or isinstance(response, Exception):  # None: pyetcd's word for a stream that just ended
            self._lost_stream(generation, response)
            return
        with self._changed:
            newest = self.revision
            for event in response.events:
                full_key = event.key.decode()
                if not full_key.startswith(self.prefix):
                    logger.warning("watch on %s got %s, outside its range: ignored", self.prefix, full_key)
                    continue
                key = full_key[len(self.prefix) :]
                if event.mod_revision <= self.revision:
                    continue  # already applied: a resumed watch may repeat what a reload read
                if isinstance(event, etcd_client.DeleteEvent):
                    self._entries.pop(key, None)
                else:
                    self._entries[key] = Entry(event.value, event.mod_revision)
                newest = max(newest, event.mod_revision)
            # etcd replays a lagging watcher's history in batches of at most 1,000 revisions, each headed with the
            # store's current revision: only a response without events (progress) vouches for the header's
            self.revision = newest if response.events else max(self.revision, response.header.revision)
            self._bump()

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _lost_stream(self, generation: int, error: Exception | None) -> None:
        with self._changed:
            if self._closed:
                return
            if generation != self._generation:
                logger.debug("watch on %s: a replaced stream ended (%s)", self.prefix, error)
                return
            self._generation += 1  # the next error of this stream is stale
            self.connected, self._watch_id = False, None
            self._bump()
            if self._resuming:
                return  # the resume under way sees that its new watch is not connected, and watches again
            self._resuming = True
        logger.debug("watch on %s broke (%s); resuming after revision %d", self.prefix, error, self.revision)
        threading.Thread(target=self._resume, name="watch-resume", daemon=True).start()

    def _resume(self) -> None:
        attempt = 0
        while True:
            with self._changed:
                if self._closed:
                    self._resuming = False
                    return
            try:
                self._watch()
            except etcd_client.RevisionCompacted:
                logger.info("etcd compacted the history of %s; reading it again", self.prefix)
                try:
                    self._load_and_watch()
                except Exception as exc:
                    logger.debug("reloading %s failed: %s", self.prefix, exc)
            except Exception as exc:
                logger.debug("resuming the watch on %s failed: %s", self.prefix, exc)
            with self._changed:
                if self.connected:  # and its stream has not failed since: _lost_stream clears it first
                    self._resuming = False
                    break
            delay = _RESUME_BACKOFF_S[min(attempt, len(_RESUME_BACKOFF_S) - 1)]
            attempt += 1
            with self._changed:
                self._changed.wait_for(lambda: self._closed, delay)
        logger.debug("watch on %s resumed after revision %d", self.prefix, self.revision)
