"""Storage seam logic that needs no server: URI parsing, credential choice, error classes,
bounded retries, and that no secret reaches uri/repr/pickle/messages."""

from __future__ import annotations

import os
import pickle

import pytest

from raylastic.checkpoint import storage as st
from raylastic.checkpoint.storage import (
    PermanentStorageError,
    RetryPolicy,
    Storage,
    StorageError,
    TransientStorageError,
    classify_error,
    parse_uri,
    retry_call,
    select_azure_credentials,
)

SECRET = "s3cr3t-VALUE-do-not-leak"


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("AWS_", "AZURE_", "GOOGLE_")) or name in st.GCS_EMULATOR_VARS:
            monkeypatch.delenv(name)


# ---------------------------------------------------------------------------- URIs

def test_local_paths_are_expanded_and_absolute(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_uri("~/runs/a").uri == str(tmp_path / "runs" / "a")
    monkeypatch.chdir(tmp_path)
    assert parse_uri("rel/dir").prefix == str(tmp_path / "rel" / "dir")
    assert parse_uri("file:///data/x/").uri == "/data/x"
    s = Storage(str(tmp_path / "r"))
    assert (s.is_local, s.root, s.path("a", "b/c")) == (True, str(tmp_path / "r"),
                                                       str(tmp_path / "r" / "a" / "b" / "c"))


@pytest.mark.parametrize("uri, kind, bucket, prefix, account, norm", [
    ("s3://bkt", "s3", "bkt", "", None, "s3://bkt"),
    ("s3://bkt/a/b/", "s3", "bkt", "a/b", None, "s3://bkt/a/b"),
    ("s3://bkt/p?region=eu-west-1&endpoint_override=http://h:9000", "s3", "bkt", "p", None,
     "s3://bkt/p?endpoint_override=http://h:9000&region=eu-west-1"),
    ("gs://g/x", "gs", "g", "x", None, "gs://g/x"),
    ("gcs://g/x", "gs", "g", "x", None, "gs://g/x"),
    ("abfs://ckpt/run", "az", "ckpt", "run", None, "abfs://ckpt/run"),
    ("az://ckpt/run", "az", "ckpt", "run", None, "az://ckpt/run"),
    ("abfs://ckpt@acct.dfs.core.windows.net/run/1", "az", "ckpt", "run/1", "acct",
     "abfs://ckpt@acct.dfs.core.windows.net/run/1"),
    ("abfss://ckpt@acct.blob.core.windows.net/", "az", "ckpt", "", "acct",
     "abfss://ckpt@acct.dfs.core.windows.net"),
])
def test_object_store_uris(uri, kind, bucket, prefix, account, norm):
    p = parse_uri(uri)
    assert (p.kind, p.bucket, p.prefix, p.account, p.uri) == (kind, bucket, prefix, account, norm)


@pytest.mark.parametrize("uri", [
    f"s3://AKIAXXX:{SECRET}@bkt/p",
    f"s3://bkt/p?secret_key={SECRET}",
    f"s3://bkt/p?access_key=AK&session_token={SECRET}",
    f"abfs://c/p?sas_token={SECRET}",
    f"abfs://c/p?account_key={SECRET}",
    f"gs://b/p?access_token={SECRET}",
])
def test_credentials_in_uri_are_rejected_without_echoing_them(uri):
    with pytest.raises(ValueError, match="environment") as info:
        parse_uri(uri)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("uri, match", [
    ("ftp://x/y", "unsupported storage scheme"),
    ("s3:///nobucket", "names no bucket"),
    ("s3://b/a/../etc", r"'\.\.'"),
    ("s3://b/p?colour=red", "unknown query option"),
    ("", "non-empty"),
])
def test_bad_uris(uri, match):
    with pytest.raises(ValueError, match=match):
        parse_uri(uri)


def test_path_refuses_to_escape_root(tmp_path):
    s = Storage(str(tmp_path))
    with pytest.raises(ValueError):
        s.path("a/../../etc")
    with pytest.raises(ValueError, match="root"):
        s.delete_dir("")


# ---------------------------------------------------------------------------- credentials

CONN = ("DefaultEndpointsProtocol=http;AccountName=devacct;AccountKey=" + SECRET +
        ";BlobEndpoint=http://127.0.0.1:10000/devacct;")


@pytest.mark.parametrize("env, account_in_uri, source, account", [
    ({"AZURE_STORAGE_CONNECTION_STRING": CONN, "AZURE_STORAGE_ACCOUNT_NAME": "other",
      "AZURE_STORAGE_ACCOUNT_KEY": SECRET}, None, "AZURE_STORAGE_CONNECTION_STRING", "devacct"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "a1", "AZURE_STORAGE_ACCOUNT_KEY": SECRET,
      "AZURE_STORAGE_SAS_TOKEN": SECRET}, None,
     "AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_ACCOUNT_KEY", "a1"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "a1", "AZURE_STORAGE_SAS_TOKEN": SECRET}, None,
     "AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_SAS_TOKEN", "a1"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "a1"}, None, "DefaultAzureCredential (azure-identity)", "a1"),
    ({}, "fromuri", "DefaultAzureCredential (azure-identity)", "fromuri"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "a1", "AZURE_STORAGE_ACCOUNT_KEY": SECRET}, "fromuri",
     "AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_ACCOUNT_KEY", "fromuri"),
])
def test_azure_credential_order(env, account_in_uri, source, account):
    creds = select_azure_credentials(env, account_in_uri)
    assert (creds.source, creds.account_name) == (source, account)
    assert SECRET not in repr(creds) and SECRET not in str(creds)


def test_azure_without_any_credentials_says_what_to_set():
    with pytest.raises(ValueError, match="AZURE_STORAGE_CONNECTION_STRING"):
        select_azure_credentials({}, None)
    with pytest.raises(ValueError, match="devacct"):
        select_azure_credentials({"AZURE_STORAGE_CONNECTION_STRING": CONN}, "otheracct")


def test_aws_and_gcs_credential_sources_are_named_not_shown():
    assert "environment" in st.describe_aws_credentials({"AWS_ACCESS_KEY_ID": "AK",
                                                         "AWS_SECRET_ACCESS_KEY": SECRET})
    assert "'dev'" in st.describe_aws_credentials({"AWS_PROFILE": "dev"})
    assert "default chain" in st.describe_aws_credentials({})
    assert st.describe_gcs_credentials({}, anonymous=True) == "anonymous"
    assert "/k.json" in st.describe_gcs_credentials({"GOOGLE_APPLICATION_CREDENTIALS": "/k.json"})


@pytest.mark.parametrize("uri, env", [
    ("s3://bkt/run?endpoint_override=http://127.0.0.1:1",
     {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": SECRET}),
    ("abfs://ckpt/run", {"AZURE_STORAGE_CONNECTION_STRING": CONN}),
    ("az://ckpt/run", {"AZURE_STORAGE_ACCOUNT_NAME": "a1", "AZURE_STORAGE_ACCOUNT_KEY": SECRET}),
    ("abfs://ckpt/run", {"AZURE_STORAGE_ACCOUNT_NAME": "a1", "AZURE_STORAGE_SAS_TOKEN": SECRET}),
    ("abfs://ckpt@a1.dfs.core.windows.net/run", {"AZURE_STORAGE_CLIENT_SECRET": SECRET}),
    ("gs://bkt/run?anonymous=true", {"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent.json"}),
])
def test_no_secret_in_uri_repr_target_or_pickle(monkeypatch, uri, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Storage(uri, retry=RetryPolicy(max_attempts=2))
    blob = pickle.dumps(s)
    for text in (s.uri, repr(s), s.target):
        assert SECRET not in text
    assert SECRET.encode() not in blob
    clone = pickle.loads(blob)  # rebuilt from uri + env, as on a Ray worker
    assert (clone.uri, clone.root, clone.retry) == (s.uri, s.root, RetryPolicy(max_attempts=2))


def test_gcs_parses_without_a_server():
    s = Storage("gs://bkt/a/b?anonymous=true&endpoint_override=127.0.0.1:4443&scheme=http")
    assert (s.kind, s.bucket, s.root, s.is_local) == ("gs", "bkt", "bkt/a/b", False)
    assert "anonymous" in s.target and "127.0.0.1:4443" in s.target


@pytest.mark.parametrize("uri, env, where, creds", [
    ("gs://bkt/run", {}, None, "Google application default credentials"),
    ("gs://bkt/run", {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443"},
     "at http://127.0.0.1:4443", "anonymous, emulator named by STORAGE_EMULATOR_HOST"),
    ("gs://bkt/run", {"STORAGE_EMULATOR_HOST": "127.0.0.1:9023/"},
     "at http://127.0.0.1:9023", "anonymous, emulator named by STORAGE_EMULATOR_HOST"),
    ("gs://bkt/run", {"CLOUD_STORAGE_EMULATOR_ENDPOINT": "http://h1:1",
                      "STORAGE_EMULATOR_HOST": "http://h2:2"},
     "at http://h1:1", "emulator named by CLOUD_STORAGE_EMULATOR_ENDPOINT"),
    # The URI's endpoint wins over the environment and keeps the credential chain.
    ("gs://bkt/run?endpoint_override=gcs.internal:443&scheme=https",
     {"STORAGE_EMULATOR_HOST": "http://h2:2", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json"},
     "at https://gcs.internal:443", "GOOGLE_APPLICATION_CREDENTIALS=/k.json"),
])
def test_gcs_custom_endpoint_from_uri_or_emulator_variables(monkeypatch, uri, env, where, creds):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Storage(uri)
    if where:
        assert where in s.target
    else:
        assert " at " not in s.target
    assert creds in s.target
    assert pickle.loads(pickle.dumps(s)).target == s.target  # a worker rebuilds the same


def test_gcs_emulator_variable_that_is_not_an_endpoint_is_refused(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "ftp://h/x")
    with pytest.raises(PermanentStorageError, match="STORAGE_EMULATOR_HOST"):
        Storage("gs://bkt/run")


def test_redaction_of_signed_urls_and_known_secrets():
    text = f"GET https://a.blob.core.windows.net/c/x?sv=1&sig={SECRET}&se=2 key={SECRET}"
    out = st._redact(text, (SECRET,))
    assert SECRET not in out and "sig=***" in out


# ---------------------------------------------------------------------------- classify_error

def _azure(cls_name: str, status: int | None = None, message: str = "x"):
    import azure.core.exceptions as ace

    exc = getattr(ace, cls_name)(message=message)
    if status is not None:
        exc.status_code = status
    return exc


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("exc", [
    ConnectionRefusedError(111, "refused"),
    ConnectionResetError(104, "reset by peer"),
    TimeoutError("timed out"),
    OSError("When initiating multiple part upload for key 'k' in bucket 'b': AWS Error "
            "NETWORK_CONNECTION during CreateMultipartUpload operation: curlCode: 7, "
            "Could not connect to server"),
    OSError("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."),
    OSError("AWS Error UNKNOWN (HTTP status 503) during GetObject operation: Service Unavailable"),
    OSError("AWS Error UNKNOWN (HTTP status 429) during PutObject operation: Too Many Requests"),
    OSError("AWS Error INTERNAL_FAILURE during ListObjectsV2 operation"),
    OSError("google::cloud::Status(UNAVAILABLE: Retry policy exhausted ... CURL error [7]"),
    _azure("ServiceRequestError", message="Cannot connect to host 127.0.0.1:1"),
    _azure("HttpResponseError", 503, "ServerBusy"),
    _azure("HttpResponseError", 500),
    _chained(RuntimeError("Failed to upload block: boom!"),
             _azure("ServiceResponseError", message="Server disconnected")),
    TransientStorageError("already classified"),
], ids=lambda e: type(e).__name__)
def test_transient_errors(exc):
    assert classify_error(exc) == "transient"


@pytest.mark.parametrize("exc", [
    OSError("When getting information for bucket 'b': AWS Error NO_SUCH_BUCKET during "
            "HeadBucket operation: No response body."),
    OSError("AWS Error ACCESS_DENIED during HeadBucket operation: No response body."),
    OSError("AWS Error INVALID_ACCESS_KEY_ID during PutObject operation"),
    OSError("AWS Error UNKNOWN (HTTP status 403) during HeadObject operation"),
    OSError("google::cloud::Status(PERMISSION_DENIED: caller lacks storage.objects.create)"),
    PermissionError(13, "Permission denied"),
    FileNotFoundError(2, "missing"),
    _azure("ResourceNotFoundError", 404, "ErrorCode:ContainerNotFound"),
    _azure("ClientAuthenticationError", 403, "ErrorCode:AuthenticationFailed"),
    _azure("HttpResponseError", 401),
    _chained(RuntimeError("Failed to upload block: The specified container does not exist. "
                          "ErrorCode:ContainerNotFound"), _azure("ResourceNotFoundError", 404)),
    ValueError("a bug, not an outage"),
    PermanentStorageError("already classified"),
], ids=lambda e: type(e).__name__)
def test_permanent_errors(exc):
    assert classify_error(exc) == "permanent"


# ---------------------------------------------------------------------------- retries

def test_backoff_is_exponential_capped_and_jittered():
    p = RetryPolicy(max_attempts=10, base_delay_s=0.5, max_delay_s=3.0)
    assert [p.delay(a, rand=lambda: 1.0) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert p.delay(4, rand=lambda: 0.0) == 0.0
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


class _Flaky:
    def __init__(self, failures: int, exc: BaseException, result="ok"):
        self.failures, self.exc, self.result, self.calls = failures, exc, result, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return self.result


def test_transient_errors_are_retried_then_succeed():
    sleeps: list[float] = []
    fn = _Flaky(2, ConnectionResetError("reset"))
    assert retry_call(fn, RetryPolicy(max_attempts=3), sleep=sleeps.append) == "ok"
    assert fn.calls == 3 and len(sleeps) == 2


def test_retries_are_bounded_and_name_the_knob():
    sleeps: list[float] = []
    policy = RetryPolicy(max_attempts=4, base_delay_s=0.1, max_delay_s=0.25)
    fn = _Flaky(99, OSError(f"AWS Error SLOW_DOWN sig={SECRET}"))
    with pytest.raises(TransientStorageError, match="after 4 attempt") as info:
        retry_call(fn, policy, what="write 'x'", sleep=sleeps.append, secrets=(SECRET,))
    assert fn.calls == 4 and len(sleeps) == 3
    assert all(0 <= d <= 0.25 for d in sleeps)
    assert "max_attempts=4" in str(info.value) and SECRET not in str(info.value)
    assert info.value.__cause__ is None  # an SDK message may carry a signed URL


def test_permanent_errors_fail_fast():
    fn = _Flaky(99, OSError("AWS Error NO_SUCH_BUCKET during HeadBucket operation"))
    with pytest.raises(PermanentStorageError, match="NO_SUCH_BUCKET"):
        retry_call(fn, RetryPolicy(), sleep=lambda s: pytest.fail("slept"))
    assert fn.calls == 1


@pytest.mark.parametrize("exc", [FileNotFoundError("missing"), KeyError("bug"), TypeError("bug")])
def test_not_found_and_bugs_propagate_unwrapped(exc):
    fn = _Flaky(99, exc)
    with pytest.raises(type(exc)):
        retry_call(fn, RetryPolicy(), sleep=lambda s: pytest.fail("slept"))
    assert fn.calls == 1


def test_errors_pickle_across_processes():
    for cls in (StorageError, TransientStorageError, PermanentStorageError):
        err = pickle.loads(pickle.dumps(cls("bucket 'b': boom")))
        assert type(err) is cls and str(err) == "bucket 'b': boom"
    assert issubclass(TransientStorageError, StorageError)
    assert issubclass(PermanentStorageError, StorageError)
