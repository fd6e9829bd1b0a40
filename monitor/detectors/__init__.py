"""Detectors, one module each, behind the small interface in ``base``."""

from monitor.detectors.base import SEVERITIES, Detector, Finding
from monitor.detectors.nan_inf import NanInf

__all__ = ["ALL_DETECTORS", "SEVERITIES", "Detector", "Finding", "NanInf"]

ALL_DETECTORS: tuple[type[Detector], ...] = (NanInf,)
