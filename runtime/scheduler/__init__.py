"""The scheduler: continuous batching with prefix-aware admission, chunked prefill and retraction."""

from radixlm.runtime.scheduler.hooks import DisaggregationHook, SchedulerOps
from radixlm.runtime.scheduler.state import StepStats
from radixlm.runtime.scheduler.step import Scheduler

__all__ = ["DisaggregationHook", "Scheduler", "SchedulerOps", "StepStats"]
