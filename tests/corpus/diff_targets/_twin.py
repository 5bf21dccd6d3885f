"""Shared by the differential-diagnosis corpus targets: is the bug switched off (DISTDIAG_TWIN=healthy)."""

import os

HEALTHY = os.environ.get("DISTDIAG_TWIN") == "healthy"
RANK = int(os.environ.get("RANK", "0"))
