"""The quorum backend (Redlock): one lock over N independent member backends, held by a
majority (:class:`~.backend.QuorumBackend`); how a call reaches every member
(:mod:`.round`) and one member's calls in this process (:mod:`.gate`)."""

from __future__ import annotations

from .backend import QuorumBackend

__all__ = ["QuorumBackend"]
