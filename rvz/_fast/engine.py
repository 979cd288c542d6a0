"""The per-peer protocol engine (sans-IO): credit, requests, parked waiters, dispatch."""

from __future__ import annotations
