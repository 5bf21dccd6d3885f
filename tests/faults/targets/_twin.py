"""Shared by the fault targets: is the bug switched off, and which rank is this."""

import os

HEALTHY = os.environ.get("DISTDIAG_TWIN") == "healthy"
RANK = int(os.environ.get("RANK", "0"))
