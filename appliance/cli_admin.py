"""``appliance migrate | user ... | key ...``: household accounts from the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.settings import Settings
from appliance.vocab import CLASS_LABELS, Klass

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


def db_path(settings: Settings) -> Path:
    from appliance.store.db import db_file

    return db_file(settings.store.data_dir)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from appliance import settings as settings_mod

    mig = sub.add_parser("migrate", help="create or upgrade the database")
    settings_mod.add_flags(mig)

    user = sub.add_parser("user", help="household accounts")
    settings_mod.add_flags(user)
    usub = user.add_subparsers(dest="user_cmd", required=True)
    add = usub.add_parser("add", help="add a user (password read from stdin or generated)")
    add.add_argument("name")
    add.add_argument("--role", default="member", choices=("member", "admin"))
    add.add_argument("--max-class", dest="user_max_class", default=Klass.INTERACTIVE.label,
                     choices=CLASS_LABELS)
    add.add_argument("--password-stdin", action="store_true",
                     help="read the password from standard input instead of generating one")
    add.add_argument("--weight", type=float, default=1.0,
                     help="fair-share weight, 0.01 to 100 (2: twice the service of 1)")
    add.add_argument("--if-no-admin", action="store_true",
                     help="do nothing when an enabled admin already exists (used by install.sh)")
    usub.add_parser("list", help="list users")
    pw = usub.add_parser("passwd", help="set a new password (read from stdin or generated)")
    pw.add_argument("name")
    pw.add_argument("--password-stdin", action="store_true")
    dis = usub.add_parser("disable", help="disable a user (--enable to undo)")
    dis.add_argument("name")
    dis.add_argument("--enable", action="store_true")

    key = sub.add_parser("key", help="API keys")
    settings_mod.add_flags(key)
    ksub = key.add_subparsers(dest="key_cmd", required=True)
    kc = ksub.add_parser("create", help="create a key for a user (shown once)")
    kc.add_argument("user")
    kc.add_argument("--name", default="default")
    kc.add_argument("--max-class", dest="key_max_class", default=None,
                    choices=CLASS_LABELS)
    kc.add_argument("--default-class", dest="key_default_class", default=None,
                    choices=CLASS_LABELS,
                    help="class of requests that ask for none (Home Assistant cannot send "
                         "headers: give its key 'voice'); default: the key's maximum")
    kl = ksub.add_parser("list", help="list keys")
    kl.add_argument("--user", default=None)
    kr = ksub.add_parser("revoke", help="revoke a key by its prefix")
    kr.add_argument("prefix")


def _password(args: argparse.Namespace) -> tuple[str, bool]:
    from appliance.store.auth import generate_password

    if getattr(args, "password_stdin", False):
        return sys.stdin.readline().rstrip("\n"), False
    return generate_password(), True


def run(settings: Settings, args: argparse.Namespace) -> int:
    from appliance.store import migrate

    path = db_path(settings)
    migrate.check_database(path)  # a damaged file: cli.main says so in one line
    if args.cmd == "migrate":
        print(f"database {path} is at revision {migrate.current_revision(path)}")
        return 0
    from appliance.store.db import open_store
    from appliance.store.errors import AlreadyExists, LastAdmin, NotFound

    store = open_store(path)
    try:
        with store.sessions.begin() as s:
            if args.cmd == "user":
                return _user(s, args)
            return _key(s, args)
    except (ValueError, NotFound, AlreadyExists, LastAdmin) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


def _user(s: Session, args: argparse.Namespace) -> int:
    from appliance.store import users

    if args.user_cmd == "add":
        if args.if_no_admin and any(u.role == "admin" and not u.disabled
                                    for u in users.list_users(s)):
            print("an admin exists already; no user added")
            return 0
        password, generated = _password(args)
        users.create_user(s, args.name, password, role=args.role,
                          max_class=args.user_max_class, weight=args.weight)
        print(f"added {args.role} {args.name}")
        if generated:
            print(f"password (shown once): {password}")
        return 0
    if args.user_cmd == "list":
        for u in users.list_users(s):
            state = "disabled" if u.disabled else "active"
            print(f"{u.id}\t{u.name}\t{u.role}\t{u.max_class}\tweight={u.weight:g}\t{state}")
        return 0
    user = users.require_user(s, args.name)
    if args.user_cmd == "passwd":
        password, generated = _password(args)
        users.set_password(s, user, password)
        print(f"password of {user.name} changed" + (f": {password}" if generated else ""))
        return 0
    users.disable_user(s, user, disabled=not args.enable)
    print(f"{user.name} {'enabled' if args.enable else 'disabled'}")
    return 0


def _key(s: Session, args: argparse.Namespace) -> int:
    from appliance.store import keys, users

    if args.key_cmd == "create":
        user = users.require_user(s, args.user)
        key, plaintext = keys.create_api_key(s, user, args.name, args.key_max_class,
                                             default_class=args.key_default_class)
        default = f", default {key.default_class}" if key.default_class else ""
        print(f"key {key.prefix} for {user.name} (class {key.max_class}{default}); "
              "shown once:")
        print(plaintext)
        return 0
    if args.key_cmd == "list":
        uid = users.require_user(s, args.user).id if args.user else None
        for k in keys.list_keys(s, user_id=uid, include_revoked=True):
            state = "revoked" if k.revoked_at else "active"
            print(f"{k.prefix}\tuser={k.user_id}\t{k.name}\t{k.max_class}\t"
                  f"default={k.default_class or k.max_class}\t{state}")
        return 0
    k = keys.revoke_key(s, args.prefix)
    print(f"key {k.prefix} revoked")
    return 0


def model_use(settings: Settings, name: str) -> int:
    """``appliance model use NAME|PATH``: record the choice for the next start, as the
    Models page does (a running daemon keeps its model until then: the page or
    ``POST /admin/model`` change it at once)."""
    from appliance.service import model_choice
    from appliance.store import migrate
    from appliance.store.db import open_store

    try:
        path = model_choice.model_folder(name, settings.models_dir)
    except model_choice.ModelRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    db = db_path(settings)
    migrate.check_database(db)
    store = open_store(db)
    try:
        with store.sessions.begin() as s:
            model_choice.record(s, path, settings.engine.model)
    finally:
        store.close()
    print(f"the next start serves {path}")
    print("a running daemon keeps its model until then; the Models page (or POST "
          "/admin/model) changes it at once")
    return 0
