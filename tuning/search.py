"""The sweep's search: the prediction first, then the splits the devices' own measured speeds call for, then TPE.

A share sweep is not a blind search: every trial measures each device's samples/s of its
own compute (the figure the rebalancer splits by). The first trial runs the prediction;
its measurements give a second point, the split by speed the devices really have, which a
prediction from the catalog can miss by a factor (throttled devices at 0.48 : 0.12 of a
core ran best at 5 : 1 where the catalog said 2.5 : 1). A device's speed changes with the
batch it gets (a step has a fixed part as well as one per sample), so from the second
trial on the next point is where a line ``fixed + per_sample × share`` fitted per type to
all trials so far has every device finish together; each measured point's trial gives the
next, until a point comes back to one already tried. Optuna's TPE then searches around
them, told every result.

Imports Ray Tune and Optuna, so it is imported only once the sweep runs.
"""

from __future__ import annotations

import math
from typing import Any

from ray.tune.search.optuna import OptunaSearch

from tuning.space import WEIGHT_PREFIX, Measured, ShareSpace
from tuning.trial import SHARE_PREFIX, SPEED_PREFIX

# A measured point whose every weight is within this of the prediction's is the prediction again (padded
# devices run at the catalog's speeds): TPE's next point is worth more than a repeat.
SAME_POINT = 0.05


class MeasuredBalanceSearch(OptunaSearch):
    """``OptunaSearch`` that, once the first trial completes, suggests the point its measured speeds give, then
    the point that trial's speeds give, and so on while each is new.

    Those points are Tune's trials like any other; Optuna is told their results as evaluated points
    (``add_evaluated_point``), since it did not ask for them. The state lives on the instance, so
    ``OptunaSearch.save`` / ``restore`` (Tune's checkpoint of the searcher) keep it for ``--resume``.
    """

    def __init__(self, space: ShareSpace, **kwargs: Any) -> None:
        super().__init__(points_to_evaluate=[space.first_point()], **kwargs)
        self._share_space = space
        self._next: dict | None = None  # the measured point to suggest next, once known
        self._ours: dict[str, dict] = {}  # trial id → the measured point it runs
        self._tried: list[dict] = []  # every point suggested so far
        self._measured: list[Measured] = []  # every completed trial's shares and speeds
        self._seeded = False

    def suggest(self, trial_id: str) -> dict | None:
        if self._next is not None:
            point, self._next = self._next, None
            self._ours[trial_id] = point
        else:
            point = super().suggest(trial_id)
        if isinstance(point, dict):
            self._tried.append(dict(point))
        return dict(point) if isinstance(point, dict) else point

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id not in self._ours:
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        ours = self._ours.pop(trial_id, None)
        value = (result or {}).get(self.metric)
        if ours is not None:
            self.add_evaluated_point(ours, value if value is not None else 0.0, error=error or value is None)
        else:
            super().on_trial_complete(trial_id, result, error)
        if error or not result:
            return
        self._measured.append(
            Measured(
                shares={k.removeprefix(SHARE_PREFIX): v for k, v in result.items() if k.startswith(SHARE_PREFIX)},
                speeds={k.removeprefix(SPEED_PREFIX): v for k, v in result.items() if k.startswith(SPEED_PREFIX)},
            )
        )
        # The chain: the prediction's trial, then each measured point's own.
        if ours is None and self._seeded:
            return
        self._seeded = True
        point = self._share_space.balanced_point(self._measured, like=result.get("config", {}))
        if point and not any(self._same(point, tried) for tried in self._tried):
            self._next = point

    @staticmethod
    def _same(a: dict, b: dict) -> bool:
        """Whether every weight of ``a`` is within ``SAME_POINT`` of ``b``'s."""
        weights = [k for k in a if k.startswith(WEIGHT_PREFIX)]
        return all(k in b and abs(math.log(a[k] / b[k])) <= math.log1p(SAME_POINT) for k in weights)
