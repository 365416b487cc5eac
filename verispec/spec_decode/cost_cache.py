"""The learned cost constants (spec_decode/step_costs.py) kept between runs, per machine, model and
drafter, in $VERISPEC_CACHE_DIR/step-costs.json, so that a new engine starts from what the last
one on this machine learned rather than from constants measured on another CPU.

The file is sealed as every cache file is (verispec.files: a checksum beside it, written with it);
a file that is not intact, or an entry of another format or out of range, is ignored with one
logged line (the engine then starts from the declared constants), never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

from ..files import atomic_path, cache_dir, intact
from .step_costs import LearnedCosts

_log = logging.getLogger(__name__)
# 2: fits that no longer count probes' drafting calls (a probe catches up on the positions
# skipped at K = 0) nor a hybrid's lookup drafts; a fit of format 1 priced EAGLE's calls up to 4x
# too high. 3: EAGLE's declared prices (the scales' unit) are its compiled call's, about half of
# format 2's; a learner that only ever probed kept format 2's scale 1 on them. 4: EAGLE's call
# price without the Python its inputs took (per_call 0.16 -> 0.08).
FORMAT = 4
FILE_NAME = "step-costs.json"


class CostCache:
    """key: what the constants depend on (the machine, the model, the drafter); path: the file,
    the cache directory's by default."""

    def __init__(self, key: str, path: Path | None = None) -> None:
        self._name = key
        self.key = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        self.path = path or cache_dir() / FILE_NAME

    def batch(self, batch_class: int) -> CostCache:
        """The entry of this key for steps of one batch class (cost_learner.batch_class), in the
        same file."""
        return CostCache(f"{self._name} | batch {batch_class}", self.path)

    def _read(self) -> dict:
        if not self.path.is_file():
            return {}
        if not intact(self.path):
            _log.warning("verispec: ignoring the cost cache %s: not the bytes written", self.path)
            return {}
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError) as error:
            _log.warning("verispec: ignoring the unreadable cost cache %s (%s)", self.path, error)
            return {}
        return saved if isinstance(saved, dict) else {}

    def load(self) -> LearnedCosts | None:
        """This key's constants, or None (nothing saved, or an entry that fails its checks)."""
        entry = self._read().get(self.key)
        if entry is None:
            return None
        if isinstance(entry, dict) and entry.get("format") != FORMAT:
            _log.warning("verispec: ignoring a stale entry of the cost cache %s (format %r, expected %d): "
                         "starting from the declared costs", self.path, entry.get("format"), FORMAT)
            return None
        try:
            costs = LearnedCosts(float(entry["row_cost"]), float(entry["first_scale"]), float(entry["rest_scale"]))
            if not (0 < costs.row_cost < 100 and all(0 <= s < 1000 and math.isfinite(s)
                                                     for s in (costs.first_scale, costs.rest_scale))):
                raise ValueError(f"its values are out of range: {costs}")
        except (KeyError, TypeError, ValueError) as error:
            _log.warning("verispec: ignoring a damaged entry of the cost cache %s (%s)", self.path, error)
            return None
        return costs

    def save(self, costs: LearnedCosts) -> None:
        """Replaces this key's entry; a cache that cannot be written is logged and skipped."""
        saved = self._read()
        saved[self.key] = {"format": FORMAT, "row_cost": costs.row_cost, "first_scale": costs.first_scale,
                           "rest_scale": costs.rest_scale}
        try:
            with atomic_path(self.path, sealed=True) as tmp:
                tmp.write_text(json.dumps(saved, indent=1))
        except OSError as error:
            _log.warning("verispec: could not save the learned step costs under %s (%s)", self.path, error)
