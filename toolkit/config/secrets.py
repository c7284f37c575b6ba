"""Credentials inside URIs (`https://user:password@host`): parakit writes every configuration value
into config.yaml, Hydra's .hydra/ files, the trackers' parameters and its log, so a value that
carries a password is refused before anything is written, and shown with the password masked.
Tools take credentials from their own environment variables instead (MLflow:
MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN)."""

from __future__ import annotations

import re

# scheme://user:password@ (RFC 3986's userinfo with a ':'): the password is what follows the ':'
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s@:]*:)(?P<password>[^/\s@]+)@")

MLFLOW_FIELD = "train.mlflow_tracking_uri"


def has_password(text: str) -> bool:
    return bool(_USERINFO.search(text))


def masked(text: str) -> str:
    """`text` with each URI's password replaced by ***."""
    return _USERINFO.sub(lambda m: f"{m['head']}***@", text)


def credentials_fix(field: str) -> str:
    """How to pass the credentials of `field` without writing them anywhere."""
    if field == MLFLOW_FIELD:
        return (
            "export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) where parakit "
            f"runs, and give {field} without the user:password@ part"
        )
    return f"give {field} without the user:password@ part, and pass the credentials through the tool's environment"
