"""The sweep's search: the prediction first, then the split the devices' own measured speeds call for, then TPE.

A share sweep is not a blind search: every trial measures each device's samples/s of its
own compute (the figure the rebalancer splits by). The first trial runs the prediction;
its measurements give a second point, the split by speed the devices really have, which a
prediction from the catalog can miss by a factor (throttled devices at 0.48 : 0.12 of a
core ran best at 5 : 1 where the catalog said 2.5 : 1). Optuna's TPE then searches around
both, told both results.

Imports Ray Tune and Optuna, so it is imported only once the sweep runs.
"""

from __future__ import annotations

import math
from typing import Any

from ray.tune.search.optuna import OptunaSearch

from tuning.space import WEIGHT_PREFIX, ShareSpace
from tuning.trial import SPEED_PREFIX

# A measured point whose every weight is within this of the prediction's is the prediction again (padded
# devices run at the catalog's speeds): TPE's next point is worth more than a repeat.
SAME_POINT = 0.05


class MeasuredBalanceSearch(OptunaSearch):
    """``OptunaSearch`` that, once the first trial completes, suggests the point its measured speeds give.

    That point is Tune's trial like any other; Optuna is told its result as an evaluated point
    (``add_evaluated_point``), since it did not ask for it. Its state lives on the instance, so
    ``OptunaSearch.save`` / ``restore`` (Tune's checkpoint of the searcher) keep it for ``--resume``.
    """

    def __init__(self, space: ShareSpace, **kwargs: Any) -> None:
        super().__init__(points_to_evaluate=[space.first_point()], **kwargs)
        self._share_space = space
        self._measured: dict | None = None  # the point to suggest next, once known
        self._measured_trial: str | None = None  # the trial that runs it
        self._seeded = False

    def suggest(self, trial_id: str) -> dict | None:
        if self._measured is not None and self._measured_trial is None:
            self._measured_trial = trial_id
            return dict(self._measured)
        return super().suggest(trial_id)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id != self._measured_trial:
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id == self._measured_trial:
            value = (result or {}).get(self.metric)
            self.add_evaluated_point(
                dict(self._measured), value if value is not None else 0.0, error=error or value is None
            )
            return
        super().on_trial_complete(trial_id, result, error)
        if not self._seeded and result and not error:
            self._seeded = True
            speeds = {k.removeprefix(SPEED_PREFIX): v for k, v in result.items() if k.startswith(SPEED_PREFIX)}
            point = self._share_space.measured_point(speeds, like=result.get("config", {}))
            first = self._share_space.first_point()
            weights = [k for k in first if k.startswith(WEIGHT_PREFIX)]
            if point and any(abs(math.log(point[k] / first[k])) > math.log1p(SAME_POINT) for k in weights):
                self._measured = point
