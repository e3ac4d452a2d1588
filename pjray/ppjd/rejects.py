"""What the PPJD job may turn into a reject: a problem with a row's data, never a bug.

A stage records a row as rejected (stage and reason, in the rejects file) when it returns a
reason or raises `RowDataError`: a corrupt image, a missing field, an answer no rewriter can
perturb, a model's unusable reply. Every other exception (a `TypeError` or `KeyError` in pjray's
own code) propagates and fails the job, and a shard whose stage rejects almost every row stops
it too (`pjray.ppjd.pipeline.check_reject_rates`): a bug must never pass for data.
"""

from __future__ import annotations

from pjray.errors import InputError


class RowDataError(InputError):
    """This row's data cannot make a PPJD item; the message is the reject reason."""

    what = "bad data"


class RejectRateError(RuntimeError):
    """A stage rejected more than `ppjd.max_reject_fraction` of the rows of a shard that reached
    it: more likely a broken stage or a misconfigured job than bad data."""
