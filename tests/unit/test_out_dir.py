"""train.out_dir is checked as the launcher checks it before any process starts: made when
missing, refused in one line naming the key when a file is in the way or it cannot be made."""

import pytest

from hybrid.errors import InputError
from hybrid.train.config import load_config
from hybrid.train.loop import check_out_dir


def _cfg(out_dir):
    return load_config(None, ["model.name=dlrm", f"train.out_dir={out_dir}"])


def test_a_missing_out_dir_is_made(tmp_path):
    check_out_dir(_cfg(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


def test_a_file_where_the_out_dir_goes_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match=r"^train\.out_dir .*/f: a file is there, not a folder$"):
        check_out_dir(_cfg(tmp_path / "f"))
    with pytest.raises(InputError, match=r"^train\.out_dir .*/f/sub: cannot create it \(Not a directory\)$"):
        check_out_dir(_cfg(tmp_path / "f" / "sub"))
