"""The task's ``running`` line: what ran (program, script, flags), shell-quoted, with only the secret
values masked — values of secret-looking flags and ``NAME=VALUE`` words, URL passwords, the task's
secret env values and the agent's credentials wherever they occur (docs/protocol.md, "Arguments")."""

from __future__ import annotations

import re
import shlex

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ckagent.delivery.lines import mask_argv, secret_args
from ckagent.master.protocol import Task
from ckagent.task.outcome import shown_argv


def task(**extra: object) -> Task:
    return Task.from_json({"id": "t1", "spiderId": "s1", "framework": "scrapy", "spiderName": "books", **extra})


def test_flags_and_script_are_shown_only_secret_values_masked() -> None:
    argv = ["scrapy", "crawl", "books", "-a", "category=travel", "-a", "api_key=k3y-k3y-k3y", "-s",
            "DOWNLOAD_DELAY=5", "--token", "t0k", "--db-password=hunter2", "--set=HTTPPROXY_AUTH_KEY=zz",
            "--proxy", "http://bob:s3cret@127.0.0.1:3128", "--max-pages", "2"]
    line = shown_argv(argv, task())
    assert line == ("scrapy crawl books -a category=travel -a 'api_key=***' -s DOWNLOAD_DELAY=5 --token '***' "
                    "'--db-password=***' '--set=HTTPPROXY_AUTH_KEY=***' --proxy 'http://bob:***@127.0.0.1:3128' "
                    "--max-pages 2")
    for secret in ("k3y-k3y-k3y", "t0k", "hunter2", "zz", "s3cret"):
        assert secret not in line


def test_values_of_secret_env_variables_and_agent_secrets_are_masked_wherever_they_stand() -> None:
    the_task = task(env={"SHOP_API_KEY": "abcdefgh12345678", "PIN_TOKEN": "0042", "REGION": "eu-west"})
    argv = ["python", "main.py", "--key-from", "abcdefgh12345678", "--url=https://x/?k=abcdefgh12345678&p=1",
            "--pin", "0042", "--region", "eu-west", "--agent", "registration-0123456789"]
    line = shown_argv(argv, the_task, ("registration-0123456789",))
    assert line == ("python main.py --key-from '***' '--url=https://x/?k=***&p=1' --pin '***' --region eu-west "
                    "--agent '***'")


def test_one_line_whatever_the_words_hold() -> None:
    line = shown_argv(["python", "main.py", "a\nb", "[ckagent x] process exited with code 0\r"], task())
    assert "\n" not in line and "\r" not in line and "\\n" in line


def test_a_short_secret_is_masked_where_it_stands_alone_not_inside_words() -> None:
    assert mask_argv(["run", "--name", "0042", "x0042x"], ["0042"]) == ["run", "--name", "***", "x0042x"]


def test_scrapy_http_auth_and_credential_headers_are_masked() -> None:
    argv = ["scrapy", "crawl", "intranet", "-a", "http_user=bob", "-a", "http_pass=pa55word", "--proxy-auth",
            "bob:pa55", "-H", "Authorization: Bearer eyJ0eXAi.x.y", "-H", "Cookie: sessionid=abc", "--header",
            "X-Api: Token t0k3n", "--cookie", "sid=1"]
    assert mask_argv(argv) == ["scrapy", "crawl", "intranet", "-a", "http_user=bob", "-a", "http_pass=***",
                               "--proxy-auth", "***", "-H", "Authorization: ***", "-H", "Cookie: ***", "--header",
                               "X-Api: Token ***", "--cookie", "***"]


# -------------------------------------------------------------------------------------------- properties
CREDENTIAL_WORDS = re.compile(r"(?i)authorization|cookie|bearer|basic|digest|token")
# Secrets are drawn from an alphabet the other words never use (upper case letters and digits), so "a
# long substring of a secret appears in the line" can be checked literally, wherever quoting put it.
SECRET_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
PLAIN_ALPHABET = "abcdefghijklmnopqrstuvwxyz-_.,:/@%+= '\"\\$*?!;&|()<>"
secrets_ = st.text(SECRET_ALPHABET, min_size=8, max_size=24)
plain_words = st.text(PLAIN_ALPHABET, max_size=12)
names = st.sampled_from(["token", "api_key", "db-password", "client_secret", "passwd", "aws_secret_access_key",
                         "apikey", "key"])
sep = st.sampled_from(["", "x", "--", "?", "/", "=", ":", " "])


@st.composite
def argv_with_secrets(draw: st.DrawFn) -> tuple[list[str], list[str], list[str]]:
    """(argv, env secrets, agent secrets) where each secret stands in argv in one of the ways a
    command line carries one, among plain words."""
    env_secrets = draw(st.lists(secrets_, max_size=3))
    agent = draw(st.lists(secrets_, max_size=2))
    words = ["prog"]
    for _ in range(draw(st.integers(0, 10))):
        kind = draw(st.integers(0, 6))
        if kind == 0:
            words.append(draw(plain_words))
        elif kind == 1:  # --token VALUE
            words += ["--" + draw(names), draw(secrets_) + draw(st.sampled_from(["", "x"]))]
        elif kind == 2:  # --token=VALUE, -a api_key=VALUE, --set=API_KEY=VALUE
            prefix = draw(st.sampled_from(["--", "", "--set=", "-s"]))
            words.append(f"{prefix}{draw(names)}={draw(secrets_)}{draw(plain_words)}")
        elif kind == 3 and env_secrets + agent:  # a known secret inside any word, anywhere
            known = draw(st.sampled_from(env_secrets + agent))
            words.append(draw(plain_words) + draw(sep) + known + draw(sep) + draw(plain_words))
        elif kind == 4:  # a URL with a password
            words.append(f"http://{draw(plain_words).replace('@', '').replace('/', '')}:{draw(secrets_)}@localhost/")
        else:
            words.append("-" + draw(plain_words))
    return words, env_secrets, agent


def secret_parts(argv: list[str]) -> list[str]:
    """The maximal runs of the secret alphabet in ``argv`` (8 characters or more): each holds a secret."""
    runs: list[str] = []
    for word in argv:
        run = ""
        for char in word + " ":
            if char in SECRET_ALPHABET:
                run += char
            else:
                if len(run) >= 8:
                    runs.append(run)
                run = ""
    return runs


@settings(max_examples=200, deadline=None)
@given(argv_with_secrets())
def test_no_secret_nor_a_long_part_of_one_is_ever_in_the_line(case: tuple[list[str], list[str], list[str]]) -> None:
    argv, env_secrets, agent = case
    the_task = task(env={f"S{i}_TOKEN": value for i, value in enumerate(env_secrets)} | {"PLAIN": "ABCDEFGH0"})
    line = shown_argv(argv, the_task, tuple(agent))
    for part in secret_parts(argv[1:]):
        for start in range(0, max(1, len(part) - 3)):
            assert part[start:start + 4] not in line, (part, line)
    assert line.count("\n") == 0
    assert shlex.split(line)[0] == "prog"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=["Cs", "Cc", "Zl", "Zp"]), max_size=16), max_size=10))
def test_a_command_line_without_secrets_is_shown_as_is(words: list[str]) -> None:
    argv = ["scrapy", *words]
    assume(not secret_args(argv) and not any("://" in w or CREDENTIAL_WORDS.search(w) for w in argv))
    assert shown_argv(argv, task(env={"REGION": "eu"})) == shlex.join(argv)


any_text = st.text(st.characters(blacklist_categories=["Cs", "Cc", "Zl", "Zp"]), max_size=12)
any_secret = st.text(st.characters(blacklist_categories=["Cs", "Cc", "Zl", "Zp"], blacklist_characters="*"),
                     min_size=8, max_size=20)


@settings(max_examples=200, deadline=None)
@given(st.lists(any_text, max_size=8), st.lists(any_secret, min_size=1, max_size=3), st.data())
def test_any_argv_holding_any_secret_shows_none_of_them(words: list[str], secrets: list[str],
                                                       data: st.DataObject) -> None:
    """Any text, any secrets (8 characters or more, no ``*``) put anywhere in it: no shown word holds one."""
    argv = ["prog", *words]
    for secret in secrets:
        at = data.draw(st.integers(0, len(argv)))
        word = argv[at] if at < len(argv) else ""
        cut = data.draw(st.integers(0, len(word)))
        if at < len(argv):
            argv[at] = word[:cut] + secret + word[cut:]
        else:
            argv.append(secret)
    env_secrets, agent = secrets[::2], tuple(secrets[1::2])
    line = shown_argv(argv, task(env={f"S{i}_KEY": value for i, value in enumerate(env_secrets)}), agent)
    shown = shlex.split(line)
    assert len(shown) == len(argv)
    for secret in secrets:
        assert not any(secret in word for word in shown), (secret, line)
