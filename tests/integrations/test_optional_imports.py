"""transformers and lightning stay optional: distdiag and distdiag.integrations import without
them, and each callback module says which package to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distdiag.errors import ConfigError
from distdiag.integrations import DiagnosticsConfig

_HIDE = "import sys; sys.modules['transformers'] = None; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"


@pytest.mark.parametrize("module,package", [("distdiag.integrations.hf", "pip install transformers"),
                                            ("distdiag.integrations.lightning", "pip install lightning")])
@pytest.mark.timeout(60)
def test_missing_framework_names_the_package(cli_env, module, package):
    code = _HIDE + "import distdiag, distdiag.integrations\nassert 'torch' not in sys.modules\n" + f"import {module}\n"
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ImportError" in proc.stderr and package in proc.stderr, proc.stderr[-2000:]
    assert "AssertionError" not in proc.stderr


def test_config_errors_name_the_key():
    from datetime import timedelta

    with pytest.raises(ConfigError, match="integrations.every must be an int >= 1, got 0"):
        DiagnosticsConfig(every=0)
    with pytest.raises(ConfigError, match="integrations.eval_timeout must be a positive timedelta"):
        DiagnosticsConfig(eval_timeout=30)
    with pytest.raises(ConfigError, match="pass every= to the callback"):
        DiagnosticsConfig(monitor_options={"every": 3})
    assert DiagnosticsConfig(timeout=timedelta(seconds=5)).budget("checkpoint") == timedelta(minutes=30)
