"""Where the engine reads its admin token: the mounted Secret file in pods, the variable for `specfleet up`."""

from __future__ import annotations

from pathlib import Path

import pytest
from specfleet.engine.server.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, token_from_env
from specfleet.operator import resources


def test_the_file_wins_over_the_variable_and_its_newline_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-the-secret\n")
    env = {ADMIN_TOKEN_FILE_ENV: str(path), ADMIN_TOKEN_ENV: "from-the-env"}
    assert token_from_env(env) == "from-the-secret"


def test_the_variable_still_works_and_nothing_set_turns_the_admin_api_off() -> None:
    assert token_from_env({ADMIN_TOKEN_ENV: "local-fleet"}) == "local-fleet"
    assert token_from_env({}) is None
    assert token_from_env({ADMIN_TOKEN_ENV: ""}) is None


@pytest.mark.parametrize("content", [None, "", "  \n"], ids=["missing", "empty", "blank"])
def test_an_unreadable_or_empty_file_is_an_error_naming_the_variable(
    tmp_path: Path, content: str | None
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"{ADMIN_TOKEN_FILE_ENV}='{path}'"):
        token_from_env({ADMIN_TOKEN_FILE_ENV: str(path), ADMIN_TOKEN_ENV: "would-be-ignored"})


def test_the_operator_renders_the_names_the_engine_reads() -> None:
    assert (resources.ADMIN_TOKEN_ENV, resources.ADMIN_TOKEN_FILE_ENV) == (
        ADMIN_TOKEN_ENV,
        ADMIN_TOKEN_FILE_ENV,
    )
