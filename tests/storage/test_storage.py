"""The Store interface: a local directory and S3 (moto, and Ceph RGW for `s3`-marked cases) behave alike,
S3 failures become StorageUnavailable with a reason, and credentials never leak into text or storage."""

from __future__ import annotations

import os
import pickle

import pytest

from app.storage import open_store
from app.storage.local import LocalStore
from app.storage.s3 import S3Store, without_userinfo
from app.storage.store import StorageUnavailable, Store, check_key, redact
from tests.s3_server import S3Endpoint, free_port

MiB = 1 << 20
ACCESS_KEY = "AKIAMAZERLLEAKCHECK1"
SECRET_KEY = "mazerl-secret-that-must-never-appear/xyz"


def use_credentials(monkeypatch, endpoint: S3Endpoint) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in endpoint.env().items():
        monkeypatch.setenv(name, value)


def s3_store(monkeypatch, endpoint: S3Endpoint, **options) -> S3Store:
    use_credentials(monkeypatch, endpoint)
    return S3Store(
        f"s3://{endpoint.new_bucket()}/runs/a",
        endpoint_url=endpoint.endpoint_url,
        multipart_threshold=5 * MiB,
        multipart_chunksize=5 * MiB,
        **options,
    )


@pytest.fixture(params=["local", "moto", pytest.param("ceph", marks=pytest.mark.s3)])
def store(request, tmp_path, monkeypatch) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return s3_store(monkeypatch, request.getfixturevalue(f"{request.param}_s3"))


@pytest.fixture(params=["moto", pytest.param("ceph", marks=pytest.mark.s3)])
def s3_endpoint(request) -> S3Endpoint:
    return request.getfixturevalue(f"{request.param}_s3")


# ---------------------------------------------------------------- the same behaviour everywhere


def test_put_get_list_exists_delete(store):
    store.put_bytes("a/b/one.txt", b"1")
    store.put_bytes("a/b/two.txt", b"22")
    store.put_bytes("a/c.txt", b"333")
    store.put_bytes("top", b"")
    assert store.get_bytes("a/b/two.txt") == b"22" and store.get_bytes("top") == b""
    assert store.exists("a/c.txt") and not store.exists("a/nope") and not store.exists("a/b")
    assert store.list() == ["a/b/one.txt", "a/b/two.txt", "a/c.txt", "top"]
    assert store.list("a/b/") == ["a/b/one.txt", "a/b/two.txt"]
    assert store.list("a/b/t") == ["a/b/two.txt"]
    assert store.list("zzz/") == []
    store.put_bytes("a/c.txt", b"replaced")
    assert store.get_bytes("a/c.txt") == b"replaced"
    assert store.delete_prefix("a/b/") == 2
    assert store.list() == ["a/c.txt", "top"]
    assert store.delete_prefix("nothing/") == 0
    with pytest.raises(FileNotFoundError):
        store.get_bytes("a/b/one.txt")
    with store.open_read("a/c.txt") as f:
        assert f.read() == b"replaced"


def test_put_file_and_get_file_large_multipart(store, tmp_path):
    big = tmp_path / "big.bin"
    payload = os.urandom(11 * MiB + 123)  # over the 5 MiB multipart threshold: three parts on S3
    big.write_bytes(payload)
    store.put_file("blobs/big.bin", big)
    back = tmp_path / "back" / "big.bin"
    back.parent.mkdir()
    store.get_file("blobs/big.bin", back)
    assert back.read_bytes() == payload
    if isinstance(store, S3Store):
        head = store.client.head_object(Bucket=store.bucket, Key=store._key("blobs/big.bin"))
        assert head["ETag"].strip('"').endswith("-3"), "the upload should have been multipart"
    assert [p.name for p in back.parent.iterdir()] == ["big.bin"]  # no temp file left behind


def test_missing_key_is_file_not_found(store, tmp_path):
    with pytest.raises(FileNotFoundError):
        store.get_bytes("no/such/key")
    with pytest.raises(FileNotFoundError):
        store.get_file("no/such/key", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_commit_dir_replaces_a_folder_and_puts_last_last(store):
    store.put_bytes("step/old-only.txt", b"old")
    order = []
    put_file = store.put_file
    store.put_file = lambda key, path: (order.append(key), put_file(key, path))
    with store.staging("step") as staged:
        for name in ("a.bin", "MANIFEST.json", "z.bin"):
            (staged / name).write_bytes(name.encode())
        store.commit_dir(staged, "step", last="MANIFEST.json")
    assert store.list("step/") == ["step/MANIFEST.json", "step/a.bin", "step/z.bin"]
    assert store.get_bytes("step/z.bin") == b"z.bin"
    if order:  # S3: one upload per file, the manifest after all others
        assert order[-1] == "step/MANIFEST.json"
    assert not any(".tmp-" in key for key in store.list())


def test_invalid_keys_are_refused(store):
    for key in ("", "/abs", "a/../b", "../escape", "a//b", "a\\b", "./a"):
        with pytest.raises(ValueError):
            store.put_bytes(key, b"x")


def test_check_key_accepts_folders_and_plain_paths():
    assert check_key("global_step_000001/") == "global_step_000001/"
    assert check_key("", allow_empty=True) == ""


# ---------------------------------------------------------------- local specifics


def test_local_write_is_atomic(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    store.put_bytes("f", b"old")

    def broken_replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        store.put_bytes("f", b"new")
    monkeypatch.undo()
    assert store.get_bytes("f") == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_local_store_reads_in_place_and_creates_its_root_lazily(tmp_path):
    store = LocalStore(tmp_path / "later")
    assert store.list() == [] and not (tmp_path / "later").exists()
    store.put_bytes("x/y", b"1")
    assert store.local_path("x/y") == (tmp_path / "later" / "x" / "y").resolve()
    assert store.describe() == str((tmp_path / "later").resolve())


def test_open_store_picks_the_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store("s3://bucket/prefix", endpoint_url="http://127.0.0.1:1"), S3Store)
    local = LocalStore(tmp_path)
    assert open_store(local) is local
    with pytest.raises(ValueError):
        open_store("gs://bucket/x")
    with pytest.raises(ValueError):
        S3Store("s3:///no-bucket")


# ---------------------------------------------------------------- S3 failures


def test_unreachable_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = S3Store("s3://bucket/p", endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=1, connect_timeout=2)
    for call in (store.check, lambda: store.list(""), lambda: store.put_bytes("k", b"x"), lambda: store.get_bytes("k")):
        with pytest.raises(StorageUnavailable) as err:
            call()
        assert err.value.reason == "endpoint unreachable"
        assert_no_secret(str(err.value), repr(err.value))


def test_missing_bucket(s3_endpoint, monkeypatch):
    use_credentials(monkeypatch, s3_endpoint)
    store = S3Store("s3://mazerl-no-such-bucket-4711/p", endpoint_url=s3_endpoint.endpoint_url)
    for call in (store.check, lambda: store.list(""), lambda: store.put_bytes("k", b"x"), lambda: store.get_bytes("k")):
        with pytest.raises(StorageUnavailable) as err:
            call()
        assert "missing" in err.value.reason and "mazerl-no-such-bucket-4711" in str(err.value)


def test_ensure_bucket_is_explicit(s3_endpoint, monkeypatch):
    use_credentials(monkeypatch, s3_endpoint)
    store = S3Store(f"s3://mazerl-made-{os.getpid()}-{free_port()}/p", endpoint_url=s3_endpoint.endpoint_url)
    with pytest.raises(StorageUnavailable):
        store.put_bytes("k", b"x")  # no bucket appears by accident
    store.ensure_bucket()
    store.ensure_bucket()  # idempotent
    store.put_bytes("k", b"x")
    assert store.get_bytes("k") == b"x"


@pytest.mark.s3
def test_bad_credentials_are_access_denied(monkeypatch, request):
    # moto does not check signatures by default, so this runs against the real server only
    endpoint = request.getfixturevalue("ceph_s3")
    bucket = endpoint.new_bucket()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = S3Store(f"s3://{bucket}/p", endpoint_url=endpoint.endpoint_url, max_attempts=1)
    for call in (store.check, lambda: store.put_bytes("k", b"x"), lambda: store.list("")):
        with pytest.raises(StorageUnavailable) as err:
            call()
        assert err.value.reason == "access denied"
        assert_no_secret(str(err.value), repr(err.value), repr(err.value.__cause__), repr(err.value.__context__))


# ---------------------------------------------------------------- credentials never leak


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert ACCESS_KEY not in text and SECRET_KEY not in text, text


def test_redact_removes_environment_credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    text = redact(
        f"signed with {ACCESS_KEY}:{SECRET_KEY}, another key AKIAABCDEFGHIJKLMNOP, extra s3cr3t!",
        extra_secrets=["s3cr3t!", None],
    )
    assert_no_secret(text)
    assert "AKIAABCDEFGHIJKLMNOP" not in text and "s3cr3t!" not in text and "signed with" in text


def test_describe_repr_and_pickles_hold_no_credentials(moto_s3, monkeypatch):
    bucket = moto_s3.new_bucket()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with_userinfo = moto_s3.endpoint_url.replace("http://", f"http://{ACCESS_KEY}:{SECRET_KEY}@")
    assert without_userinfo(with_userinfo) == moto_s3.endpoint_url
    store = S3Store(f"s3://{bucket}/p", endpoint_url=moto_s3.endpoint_url)
    store.put_bytes("k", b"v")  # resolves the credentials inside the client
    shown = S3Store(f"s3://{bucket}/p", endpoint_url=with_userinfo)
    assert moto_s3.endpoint_url in shown.describe()
    assert_no_secret(store.describe(), repr(store), str(store), shown.describe(), repr(shown))
    shipped = pickle.dumps(store)  # what Ray would send to another process
    assert ACCESS_KEY.encode() not in shipped and SECRET_KEY.encode() not in shipped
    assert pickle.loads(shipped).get_bytes("k") == b"v"
    assert_no_secret(*(store.get_bytes(k).decode() for k in store.list()))


def test_error_messages_hold_no_credentials(moto_s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = S3Store("s3://mazerl-absent-bucket/p", endpoint_url=moto_s3.endpoint_url)
    with pytest.raises(StorageUnavailable) as err:
        store.put_bytes("k", b"x")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert_no_secret(str(err.value), repr(err.value), err.getrepr().__str__())


def test_no_credentials_at_all(moto_s3, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = S3Store("s3://bucket/p", endpoint_url=moto_s3.endpoint_url, max_attempts=1)
    with pytest.raises(StorageUnavailable) as err:
        store.list("")
    assert "no AWS credentials" in err.value.reason
