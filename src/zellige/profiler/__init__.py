"""Measuring a GPU for the cost model (`zellige profile`) and checking the cost model's
predictions against ranks run for real (`zellige validate-profile`)."""

from zellige.profiler.measure import ProfileOptions, ProfileResult, profile_device
from zellige.profiler.validate import ValidationOptions, ValidationReport, validate

__all__ = [
    "ProfileOptions",
    "ProfileResult",
    "ValidationOptions",
    "ValidationReport",
    "profile_device",
    "validate",
]
