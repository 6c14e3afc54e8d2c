"""Loading a target model's tokenizer with transformers, for every process that needs one.

Most tokenizers are data (``tokenizer.json``) that transformers reads with its own code.
Some are Python code beside their files: ``tokenizer_config.json`` names the class in
``auto_map`` (Kimi K2 ships ``tiktoken.model`` and ``tokenization_kimi.py`` this way), and
loading one runs that code. datagen loads such a tokenizer only when told the folder is
trusted (``--trust-remote-code``, ``DATAGEN_TRUST_REMOTE_CODE``), and says so otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from common.errors import ConfigError

_REMOTE_CODE_FLAG = "--trust-remote-code (DATAGEN_TRUST_REMOTE_CODE=1)"
# How long the hub may take to say whether a model id exists before it counts as away.
HUB_TIMEOUT_S = 10.0


def code_class(folder: Path) -> str | None:
    """The tokenizer class a local folder names in Python code beside it, if any."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    ref = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(ref, list):
        ref = next((r for r in ref if isinstance(r, str)), None)
    return ref if isinstance(ref, str) else None


def _refuse_code(name: str, code: str) -> ConfigError:
    return ConfigError(
        f"tokenizer {name!r} has its class in Python code ({code}), and loading it runs "
        f"that code: pass {_REMOTE_CODE_FLAG} if you trust it")


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """transformers' tokenizer for a local folder (read offline) or a model id.

    ``trust_remote_code`` is always passed as a bool: left unset, transformers would ask
    on the terminal.
    """
    # transformers is slow to import; only pay for it when a templater is built. datagen
    # needs only its tokenizers and chat templates, so its advice that PyTorch is missing
    # would send users to install a GPU stack for nothing.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    if Path(name).is_dir():
        code = code_class(Path(name))
        if code is not None and not trust_remote_code:
            raise _refuse_code(name, code)
        try:
            return AutoTokenizer.from_pretrained(name, local_files_only=True,
                                                 trust_remote_code=trust_remote_code)
        except ImportError as exc:  # the folder's code imports a module not installed
            raise ConfigError(f"tokenizer directory {name!r}: its code cannot be loaded "
                              f"({exc})") from exc
        except Exception as exc:
            raise ConfigError(
                f"tokenizer directory {name!r} holds no loadable tokenizer files ({exc})"
            ) from exc
    try:
        # A model id downloaded before loads from the cache, with or without a network.
        return AutoTokenizer.from_pretrained(name, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except Exception:  # not cached (or not complete): the hub decides below
        pass
    _check_hub(name)
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise _refuse_code(name, "in the model's repository") from exc
        raise ConfigError(
            f"tokenizer {name!r} not found: not a local directory and could not be loaded "
            f"as a model id ({type(exc).__name__}: {exc})"
        ) from exc


def _check_hub(name: str) -> None:
    """ConfigError at once when the hub cannot give ``name``: offline, unreachable, or no
    such model. transformers would retry each of its files for about 50 s first."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    where = f"tokenizer {name!r} not found: not a local directory"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{where}, not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                          "set: give the tokenizer's directory")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except HFValidationError:
        raise ConfigError(f"{where} nor a model id (namespace/name)") from None
    except GatedRepoError:
        raise ConfigError(f"{where}, and model {name!r} on {constants.ENDPOINT} is gated: "
                          "accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}, and {constants.ENDPOINT} has no model {name!r} (or "
                          "it is private: log in with hf auth login)") from None
    except Exception as exc:  # the hub's client raises its transport's errors as they are
        raise ConfigError(f"{where}, not in the Hugging Face cache, and {constants.ENDPOINT} "
                          f"does not answer ({type(exc).__name__}: {exc}): give the "
                          "tokenizer's directory, or set HF_HUB_OFFLINE=1 to use the "
                          "cache only") from None
