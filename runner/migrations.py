"""The storage schema, as an ordered list of migrations; a migration's index + 1 is its version.

Applied by :meth:`agentfast.runner.store.Store.migrate` once, under a transaction-level advisory
lock, so runners and the operator starting together do not race (the failure mode of
langgraph's concurrent ``setup()``). Never edit a released migration; append a new one.

Tables (all keyed by ``run_id``, deleted with the run by ``ON DELETE CASCADE`` and renamed with it
by ``ON UPDATE CASCADE`` when an earlier run of a reused name is archived, migration 6):

- ``agentfast_runs``: one row per run: uid, spec, and the fencing ``epoch`` (G6).
- ``agentfast_messages``: the transcript, append-only, one row per message. A checkpoint inserts
  only the messages new since the last one, so its cost does not grow with the transcript.
- ``agentfast_checkpoints``: one small row per committed iteration: context, pending call,
  opaque ``sdk_state`` and the transcript length it covers. Superseded rows are pruned to the
  retention setting; the latest is the run's state.
- ``agentfast_turns``: the model's reply of an iteration, persisted before any of its tools run,
  so a resume never asks the model again for a turn whose tools may have acted.
- ``agentfast_tool_calls``: the tool-call journal (G3, G4): intent, idempotency key, result.
- ``agentfast_approvals``: human decisions, write-once.
- ``agentfast_void_decisions`` (4): decisions from ``spec.approvals`` refused because their
  call did not await one: void for good, so an entry written before its call exists (against a
  forged status) is never applied when the call later pauses (``Store.decide(once=True)``).
- ``agentfast_tenants`` (5): one row per namespace whose runners have a Postgres role of their
  own (``Store.set_tenant_password``, called by the operator): the role's name and the id of its
  current credential.
- ``agentfast_cancel_requests`` (8): a request to cancel a run (``Store.request_cancel``):
  who asked and when, at most one per run. Runner roles read it, never write it.
- ``agentfast_payloads`` (9): large values (a string over ``AGENTFAST_PAYLOAD_THRESHOLD_BYTES``,
  default 1 MiB) stored once per run, keyed by their sha256; the rows above hold a reference
  (``runner/payloads.py``), which the store resolves when it loads them.
- ``agentfast_sdk_blobs`` (10): a graph-native SDK's own state, in rows written once and
  never updated (``Store.commit_checkpoint(sdk_rows=...)``, in the checkpoint's transaction): the
  checkpoint's ``sdk_state`` stays small and only names its rows by ``key``. The runtime stores
  and returns them without interpreting them (G8); the LangGraph adapter keeps one row per list
  element it appends (a message is written once) and one per other channel value it changes.
- ``agentfast_runs.forked_from``, ``forked_at`` (13): a run made by ``Store.fork_run`` names its
  source run and the iteration it was forked at (provenance for ``agentfast history``); NULL
  for a run registered from its own spec.
- ``agentfast_notifications`` (15): the webhook notification of each awaited call
  (``runner/notify.py``): its idempotency key, the event, delivery state and attempts. Written
  by the operator (or a local CLI on the owner's DSN); runner roles have no right on it.
- ``agentfast_runners`` (3): the live runner of a run, if any: who (runner id, pid, host, its
  Postgres backend) and its last heartbeat. Only a hint for humans: liveness itself is the
  session advisory lock the runner holds (``runner/liveness.py``), which dies with its connection.
- ``agentfast_approvals.arguments_digest`` (17): the digest of the arguments a decision was
  made on (G13); an approved call runs only with arguments of that digest.
- ``agentfast_attempts`` (18): per run, the iteration its last runner started and how many
  runners crashed in it in a row (a crash loop ends the run ``Failed``/``CrashLoop``).
- ``agentfast_model_replies`` (19): the usage of every model reply, recorded when it arrives; a
  reply no saved turn kept still counts against the budget.

Least privilege (5, G11): the role that runs the migrations owns every table (and so bypasses
row-level security); runners log in as a role per namespace, member of the group role
``agentfast_runner``, which may read and write its namespace's rows of the run tables and
nothing else: row-level security compares the namespace part of ``run_id`` (``NS/NAME``) with
``agentfast_tenant()``, the namespace of the session's login role. It may read decisions but
never write one, may change a run's ``epoch`` (a takeover) but not its spec, and has no right
on ``agentfast_void_decisions``, ``agentfast_tenants`` or the schema (no DDL: runners never
migrate).

Distribution (7): every primary key and unique constraint of the run tables begins with
``run_id``, so each table can be distributed by ``run_id`` (Citus ``create_distributed_table``,
co-located with ``agentfast_runs``) without a schema change. ``agentfast_tenants`` (keyed by
namespace, read by every tenant's row-level-security check) would be a reference table, and
``agentfast_migrations`` lives on the coordinator.

The fencing trigger ``agentfast_fence`` rejects, inside Postgres, any write to the run's tables
(messages, checkpoints, turns, tool calls, payloads) from a transaction whose lease settings do not
name the run's current state: ``agentfast.epoch`` must be the run's current epoch and (migration
11) ``agentfast.run_uid``, which every Store transaction sets, the run's uid; otherwise SQLSTATE
``AF001``. A writer that sets no uid (a hand-written repair; a runner of an earlier release during
an upgrade) is checked by the epoch alone.
A runner whose lease was taken over cannot commit anything, nor can a runner of an earlier run of
the same name (deleted or archived, then re-created with a new uid, whose epochs count up again
from 0) once the new run reaches the old runner's epoch (G6).
"""

# Tables (as of migration 5) that hold a run's rows, by run_id: the ones runner roles reach.
_CHILD_TABLES = (
    "agentfast_messages",
    "agentfast_checkpoints",
    "agentfast_turns",
    "agentfast_tool_calls",
    "agentfast_approvals",
    "agentfast_runners",
)
_RUN_TABLES = ("agentfast_runs", *_CHILD_TABLES)

MIGRATIONS: list[str] = [
    # 1: the initial schema
    """
    CREATE TABLE agentfast_runs (
        run_id      text PRIMARY KEY,
        run_uid     text NOT NULL UNIQUE,
        spec        jsonb NOT NULL,
        epoch       bigint NOT NULL DEFAULT 0,
        created_at  timestamptz NOT NULL DEFAULT now()
    );

    CREATE TABLE agentfast_messages (
        run_id     text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE,
        seq        integer NOT NULL,
        iteration  integer NOT NULL,
        message    jsonb NOT NULL,
        epoch      bigint NOT NULL,
        PRIMARY KEY (run_id, seq)
    );

    CREATE TABLE agentfast_checkpoints (
        run_id          text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE,
        checkpoint_id   bigint GENERATED ALWAYS AS IDENTITY,
        checkpoint_key  uuid NOT NULL UNIQUE,
        iteration       integer NOT NULL,
        message_count   integer NOT NULL,
        phase           text NOT NULL,
        schema_version  integer NOT NULL,
        context         jsonb NOT NULL,
        pending         jsonb,
        sdk_state       jsonb NOT NULL DEFAULT '{}',
        saved_at        bigint NOT NULL,
        epoch           bigint NOT NULL,
        PRIMARY KEY (run_id, checkpoint_id)
    );

    CREATE TABLE agentfast_turns (
        run_id             text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE,
        iteration          integer NOT NULL,
        message            jsonb NOT NULL,
        prompt_tokens      integer NOT NULL,
        completion_tokens  integer NOT NULL,
        epoch              bigint NOT NULL,
        created_at         timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (run_id, iteration)
    );

    CREATE TABLE agentfast_tool_calls (
        run_id           text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE,
        iteration        integer NOT NULL,
        position         integer NOT NULL,
        call_id          text NOT NULL,
        idempotency_key  text NOT NULL UNIQUE,
        tool_call_id     text NOT NULL,
        tool_name        text NOT NULL,
        arguments        text NOT NULL,
        gated            boolean NOT NULL,
        idempotent       boolean NOT NULL,
        state            text NOT NULL CHECK (state IN ('planned', 'started', 'done')),
        attempts         integer NOT NULL DEFAULT 0,
        result           jsonb,
        epoch            bigint NOT NULL,
        started_at       timestamptz,
        finished_at      timestamptz,
        PRIMARY KEY (run_id, iteration, position),
        UNIQUE (run_id, call_id)
    );

    CREATE TABLE agentfast_approvals (
        run_id      text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE,
        call_id     text NOT NULL,
        decision    text NOT NULL CHECK (decision IN ('approve', 'deny')),
        reason      text,
        decided_by  text NOT NULL DEFAULT '',
        decided_at  timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (run_id, call_id)
    );

    CREATE FUNCTION agentfast_fence() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        mine text := current_setting('agentfast.epoch', true);
        cur bigint;
    BEGIN
        -- FOR SHARE: a takeover (UPDATE ... SET epoch = epoch + 1) waits for this transaction,
        -- and this transaction waits for a takeover in progress, so the check cannot race it.
        SELECT epoch INTO cur FROM agentfast_runs WHERE run_id = NEW.run_id FOR SHARE;
        IF mine IS NULL OR mine = '' THEN
            RAISE EXCEPTION 'agentfast: write to % for run % without a lease (agentfast.epoch unset)', TG_TABLE_NAME, NEW.run_id
                USING ERRCODE = 'AF001';
        END IF;
        IF cur IS NULL OR mine::bigint <> cur THEN
            RAISE EXCEPTION 'agentfast: run % lease lost: epoch % is stale (current %)', NEW.run_id, mine, cur
                USING ERRCODE = 'AF001';
        END IF;
        NEW.epoch := cur;
        RETURN NEW;
    END $$;

    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_messages
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_checkpoints
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_turns
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_tool_calls
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    """,
    # 2: a third decision, "complete" (the call's effect already happened), with the result the
    # model reads; a denial's reason and a completion's result are part of the decision.
    """
    ALTER TABLE agentfast_approvals ADD COLUMN result text;
    ALTER TABLE agentfast_approvals DROP CONSTRAINT agentfast_approvals_decision_check;
    ALTER TABLE agentfast_approvals ADD CONSTRAINT agentfast_approvals_decision_check
        CHECK (decision IN ('approve', 'deny', 'complete'));
    """,
    # 3: the runner heartbeat (issue 11: never take over a run whose runner is alive)
    """
    CREATE TABLE agentfast_runners (
        run_id       text PRIMARY KEY REFERENCES agentfast_runs ON DELETE CASCADE,
        runner_id    text NOT NULL,
        pid          integer NOT NULL,
        host         text NOT NULL,
        backend_pid  integer NOT NULL,
        started_at   timestamptz NOT NULL DEFAULT now(),
        beat_at      timestamptz NOT NULL DEFAULT now()
    );
    """,
    # 4: a decision from spec.approvals refused as "not awaiting" is void for good (issue 12: a
    # pre-approval written against a forged status must not fire when the call later pauses)
    """
    CREATE TABLE agentfast_void_decisions (
        run_id     text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE,
        call_id    text NOT NULL,
        why        text NOT NULL,
        voided_at  timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (run_id, call_id)
    );
    """,
    # 5: least privilege (issue 13): a group role for runners, a login role per namespace, and
    # row-level security so a namespace's runners reach only that namespace's runs.
    """
    DO $$ BEGIN
        -- Roles are the server's, not the database's: another database may have made it.
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'agentfast_runner') THEN
            CREATE ROLE agentfast_runner NOLOGIN;
        END IF;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;  -- a concurrent CREATE ROLE won
    END $$;

    CREATE TABLE agentfast_tenants (
        namespace      text PRIMARY KEY,
        role_name      text NOT NULL UNIQUE,
        credential_id  text NOT NULL,
        created_at     timestamptz NOT NULL DEFAULT now(),
        rotated_at     timestamptz NOT NULL DEFAULT now()
    );

    -- The namespace of the session's login role (session_user: SET ROLE cannot change it), or
    -- NULL for a role that is no tenant. SECURITY DEFINER: runners cannot read agentfast_tenants.
    CREATE FUNCTION agentfast_tenant() RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
        SET search_path FROM CURRENT
        AS $$ SELECT namespace FROM agentfast_tenants WHERE role_name = session_user $$;
    REVOKE ALL ON FUNCTION agentfast_tenant() FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION agentfast_tenant() TO agentfast_runner;

    GRANT SELECT ON agentfast_migrations TO agentfast_runner;
    GRANT SELECT ON agentfast_runs, agentfast_approvals TO agentfast_runner;
    GRANT UPDATE (epoch) ON agentfast_runs TO agentfast_runner;
    GRANT SELECT, INSERT ON agentfast_messages, agentfast_turns TO agentfast_runner;
    GRANT SELECT, INSERT, DELETE ON agentfast_checkpoints TO agentfast_runner;
    GRANT SELECT, INSERT, UPDATE ON agentfast_tool_calls TO agentfast_runner;
    GRANT SELECT, INSERT, UPDATE, DELETE ON agentfast_runners TO agentfast_runner;
    """
    + "".join(
        f"ALTER TABLE {t} ENABLE ROW LEVEL SECURITY;\n" for t in _RUN_TABLES + ("agentfast_void_decisions", "agentfast_tenants")
    )
    + "".join(
        f"CREATE POLICY agentfast_tenant ON {t} TO agentfast_runner USING (split_part(run_id, '/', 1) = agentfast_tenant());\n"
        for t in _RUN_TABLES
    ),
    # 6: an AgentRun re-created under an old name never touches the earlier run's rows: they are
    # kept under the id NS/NAME@UID (Store.archive_run), which needs the keys to follow a rename.
    "".join(
        f"ALTER TABLE {t} DROP CONSTRAINT {t}_run_id_fkey, ADD CONSTRAINT {t}_run_id_fkey FOREIGN KEY (run_id)"
        " REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE;\n"
        for t in _CHILD_TABLES + ("agentfast_void_decisions",)
    ),
    # 7: every primary key and unique constraint of a run table starts with run_id, so the schema
    # can be distributed by run_id (Citus) unchanged: a distributed table's unique constraints
    # must contain its distribution column. The three global ones become per run. run_uid stays
    # unique in fact (Store.create_run checks it under an advisory lock: the idempotency keys of
    # G4 are built from it), but no longer by a constraint.
    """
    ALTER TABLE agentfast_checkpoints DROP CONSTRAINT agentfast_checkpoints_checkpoint_key_key,
        ADD CONSTRAINT agentfast_checkpoints_run_id_checkpoint_key_key UNIQUE (run_id, checkpoint_key);
    ALTER TABLE agentfast_tool_calls DROP CONSTRAINT agentfast_tool_calls_idempotency_key_key,
        ADD CONSTRAINT agentfast_tool_calls_run_id_idempotency_key_key UNIQUE (run_id, idempotency_key);
    ALTER TABLE agentfast_runs DROP CONSTRAINT agentfast_runs_run_uid_key;
    CREATE INDEX agentfast_runs_run_uid ON agentfast_runs (run_uid);
    """,
    # 8: cancel (issue 14): a request to stop a run at its next safe point, who made it and when.
    # Written only by the operator's role (spec.cancel) or the CLI with the owner's DSN; a
    # runner's role may read its namespace's rows (row-level security) and never write one.
    """
    CREATE TABLE agentfast_cancel_requests (
        run_id        text PRIMARY KEY REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE,
        requested_by  text NOT NULL,
        requested_at  timestamptz NOT NULL DEFAULT now()
    );
    ALTER TABLE agentfast_cancel_requests ENABLE ROW LEVEL SECURITY;
    CREATE POLICY agentfast_tenant ON agentfast_cancel_requests TO agentfast_runner
        USING (split_part(run_id, '/', 1) = agentfast_tenant());
    GRANT SELECT ON agentfast_cancel_requests TO agentfast_runner;
    """,
    # 9: large payloads (issue 15): a string over the threshold is stored once per run, keyed by
    # its sha256, and rows refer to it (runner/payloads.py). Fenced like every table a runner
    # writes; its runners reach their namespace's rows only, and may only add them.
    """
    CREATE TABLE agentfast_payloads (
        run_id      text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE,
        digest      text NOT NULL,
        size_bytes  bigint NOT NULL,
        content     text NOT NULL,
        epoch       bigint NOT NULL,
        created_at  timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (run_id, digest)
    );
    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_payloads
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    ALTER TABLE agentfast_payloads ENABLE ROW LEVEL SECURITY;
    CREATE POLICY agentfast_tenant ON agentfast_payloads TO agentfast_runner
        USING (split_part(run_id, '/', 1) = agentfast_tenant());
    GRANT SELECT, INSERT ON agentfast_payloads TO agentfast_runner;
    -- lz4 where the server has it: pglz spends ~50 ms a MiB on output it then fails to compress
    -- (base64, hex, already compressed data); lz4 gives up at memory speed.
    DO $$ BEGIN
        ALTER TABLE agentfast_payloads ALTER COLUMN content SET COMPRESSION lz4;
    EXCEPTION WHEN feature_not_supported THEN NULL;
    END $$;
    """,
    # 10: a graph-native SDK's state as rows written once (issue 15 item 3): the LangGraph
    # adapter's sdk_state held the whole channel state, rewritten at every superstep. A row is
    # keyed by the adapter's own text key; value is the SDK's serializer's output, type its tag.
    """
    CREATE TABLE agentfast_sdk_blobs (
        run_id  text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE,
        key     text NOT NULL,
        type    text NOT NULL,
        value   bytea NOT NULL,
        epoch   bigint NOT NULL,
        PRIMARY KEY (run_id, key)
    );
    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_sdk_blobs
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    ALTER TABLE agentfast_sdk_blobs ENABLE ROW LEVEL SECURITY;
    CREATE POLICY agentfast_tenant ON agentfast_sdk_blobs TO agentfast_runner
        USING (split_part(run_id, '/', 1) = agentfast_tenant());
    GRANT SELECT, INSERT ON agentfast_sdk_blobs TO agentfast_runner;
    """,
    # 11, the uid fence migration: the lease names the run by uid and epoch. An epoch alone repeats
    # when a run is deleted or archived and a new AgentRun of the same name (a new uid) is created
    # under the same run_id: its epochs count up from 0 again, so a zombie of the old run holding
    # epoch N would pass the fence once the new run reached N. The fence now also compares the
    # run row's run_uid with the transaction's agentfast.run_uid (set with agentfast.epoch, by
    # Store._retry, so every runner of this release names it). Same triggers, same SQLSTATE;
    # only the function is replaced.
    """
    CREATE OR REPLACE FUNCTION agentfast_fence() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        mine text := current_setting('agentfast.epoch', true);
        mine_uid text := current_setting('agentfast.run_uid', true);
        cur bigint;
        cur_uid text;
    BEGIN
        -- FOR SHARE: a takeover (UPDATE ... SET epoch = epoch + 1) waits for this transaction,
        -- and this transaction waits for a takeover in progress, so the check cannot race it.
        SELECT epoch, run_uid INTO cur, cur_uid FROM agentfast_runs WHERE run_id = NEW.run_id FOR SHARE;
        IF mine IS NULL OR mine = '' THEN
            RAISE EXCEPTION 'agentfast: write to % for run % without a lease (agentfast.epoch unset)', TG_TABLE_NAME, NEW.run_id
                USING ERRCODE = 'AF001';
        END IF;
        IF cur IS NULL OR mine::bigint <> cur THEN
            RAISE EXCEPTION 'agentfast: run % lease lost: epoch % is stale (current %)', NEW.run_id, mine, cur
                USING ERRCODE = 'AF001';
        END IF;
        -- Every Store transaction names its run's uid. A writer that names none (a hand-written
        -- repair, a runner of a release before this migration during an upgrade) is checked by
        -- the epoch alone, as before.
        IF coalesce(mine_uid, '') <> '' AND mine_uid <> cur_uid THEN
            RAISE EXCEPTION 'agentfast: run % lease lost: the run was replaced: uid mismatch (lease uid %, run uid %)',
                NEW.run_id, mine_uid, cur_uid
                USING ERRCODE = 'AF001';
        END IF;
        NEW.epoch := cur;
        RETURN NEW;
    END $$;
    """,
    # 12: one statement per runner write (issue 15 items 2 and 5). Each write of a runner's
    # iteration (the turn and its plan, a call's intent, its result, the checkpoint) is one
    # function call, sent on an autocommit connection: the statement is its own transaction, so
    # one round trip does BEGIN, the lease's settings, the rows, retention and COMMIT,
    # and no transaction ever waits on the client (a frozen client holds no lock). The functions
    # run as their caller (SECURITY INVOKER): the same grants, row-level security and fence
    # trigger apply as to the statements they replace. set_config(..., true) lasts as long as
    # the transaction, here the one statement (or the caller's transaction, when the store writes
    # large payloads first in the same one).
    """
    CREATE FUNCTION agentfast_name_lease(p_epoch bigint, p_uid text) RETURNS void LANGUAGE sql AS $$
        SELECT set_config('agentfast.epoch', p_epoch::text, true), set_config('agentfast.run_uid', p_uid, true)
    $$;

    -- The write-ahead intent of one call, unless the run has a cancel request or is older than
    -- p_deadline_s (NULL: no deadline). marked: whether the call was marked started; when not,
    -- the run's epoch and uid (NULL: no such run), its age (s) and cancel request, to say why.
    CREATE FUNCTION agentfast_mark_started(p_run text, p_epoch bigint, p_uid text, p_iteration integer, p_position integer,
                                           p_deadline_s float8)
    RETURNS TABLE (marked boolean, run_epoch bigint, uid text, age_s float8, cancel_by text, cancel_at timestamptz)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM agentfast_name_lease(p_epoch, p_uid);
        UPDATE agentfast_tool_calls t SET state = 'started', attempts = t.attempts + 1, started_at = now()
            WHERE t.run_id = p_run AND t.iteration = p_iteration AND t.position = p_position AND t.state <> 'done'
              AND NOT EXISTS (SELECT 1 FROM agentfast_cancel_requests q WHERE q.run_id = p_run)
              AND (p_deadline_s IS NULL OR (SELECT extract(epoch FROM clock_timestamp() - r.created_at)
                                            FROM agentfast_runs r WHERE r.run_id = p_run) < p_deadline_s);
        IF FOUND THEN
            RETURN QUERY SELECT true, NULL::bigint, NULL::text, NULL::float8, NULL::text, NULL::timestamptz;
            RETURN;
        END IF;
        RETURN QUERY SELECT false, r.epoch, r.run_uid, extract(epoch FROM clock_timestamp() - r.created_at)::float8,
                            q.requested_by, q.requested_at
            FROM (SELECT 1) one LEFT JOIN agentfast_runs r ON r.run_id = p_run
                 LEFT JOIN agentfast_cancel_requests q ON q.run_id = p_run;
    END $$;

    -- The model's reply of an iteration and the intent rows of its calls (p_calls: a JSON array
    -- of objects with position, call_id, idempotency_key, tool_call_id, tool_name, arguments,
    -- gated, idempotent). A retry of a committed write changes nothing (ON CONFLICT). p_start:
    -- the position of a call to mark started in the same transaction, as agentfast_mark_started
    -- does (its row returned); NULL: none (no row returned).
    CREATE FUNCTION agentfast_save_turn(p_run text, p_epoch bigint, p_uid text, p_iteration integer, p_message jsonb,
                                        p_prompt_tokens integer, p_completion_tokens integer, p_calls jsonb,
                                        p_start integer, p_deadline_s float8)
    RETURNS TABLE (marked boolean, run_epoch bigint, uid text, age_s float8, cancel_by text, cancel_at timestamptz)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM agentfast_name_lease(p_epoch, p_uid);
        INSERT INTO agentfast_turns (run_id, iteration, message, prompt_tokens, completion_tokens, epoch)
            VALUES (p_run, p_iteration, p_message, p_prompt_tokens, p_completion_tokens, 0)
            ON CONFLICT (run_id, iteration) DO NOTHING;
        INSERT INTO agentfast_tool_calls (run_id, iteration, position, call_id, idempotency_key, tool_call_id, tool_name,
                                          arguments, gated, idempotent, state, epoch)
            SELECT p_run, p_iteration, c.position, c.call_id, c.idempotency_key, c.tool_call_id, c.tool_name, c.arguments,
                   c.gated, c.idempotent, 'planned', 0
            FROM jsonb_to_recordset(p_calls) AS c(position integer, call_id text, idempotency_key text, tool_call_id text,
                                                  tool_name text, arguments text, gated boolean, idempotent boolean)
            ON CONFLICT (run_id, iteration, position) DO NOTHING;
        IF p_start IS NOT NULL THEN
            RETURN QUERY SELECT * FROM agentfast_mark_started(p_run, p_epoch, p_uid, p_iteration, p_start, p_deadline_s);
        END IF;
    END $$;

    -- A call's result (absolute: a retry writes the same).
    CREATE FUNCTION agentfast_record_result(p_run text, p_epoch bigint, p_uid text, p_iteration integer, p_position integer,
                                            p_result jsonb)
    RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM agentfast_name_lease(p_epoch, p_uid);
        UPDATE agentfast_tool_calls t SET state = 'done', result = p_result, finished_at = now()
            WHERE t.run_id = p_run AND t.iteration = p_iteration AND t.position = p_position;
    END $$;

    -- One checkpoint: the new messages (p_messages: a JSON array, the first at seq p_first_seq;
    -- NULL: none), the SDK rows not stored yet (three parallel arrays), the checkpoint row, keyed
    -- by p_key so that a retry of a committed write adds nothing, retention (the latest p_keep
    -- checkpoints of the run stay). Not the progress NOTIFY: Postgres serializes the commits of
    -- notifying transactions, WAL flush included, so the store sends it in a transaction of its
    -- own that writes nothing (no flush). Returns the checkpoint's id and, with
    -- p_read_ends, the run's age (s) and cancel request (run_found false: no such run).
    CREATE FUNCTION agentfast_commit_checkpoint(
        p_run text, p_epoch bigint, p_uid text, p_key uuid, p_iteration integer, p_first_seq integer, p_messages jsonb,
        p_sdk_keys text[], p_sdk_types text[], p_sdk_values bytea[], p_message_count integer, p_phase text,
        p_schema_version integer, p_context jsonb, p_pending jsonb, p_sdk_state jsonb, p_saved_at bigint, p_keep integer,
        p_read_ends boolean)
    RETURNS TABLE (cid bigint, run_found boolean, age_s float8, cancel_by text, cancel_at timestamptz)
    LANGUAGE plpgsql AS $$
    DECLARE
        new_id bigint;
    BEGIN
        PERFORM agentfast_name_lease(p_epoch, p_uid);
        IF p_messages IS NOT NULL THEN
            INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch)
                SELECT p_run, p_first_seq + m.i - 1, p_iteration, m.message, 0
                FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS m(message, i)
                ON CONFLICT (run_id, seq) DO NOTHING;
        END IF;
        IF cardinality(p_sdk_keys) > 0 THEN
            INSERT INTO agentfast_sdk_blobs (run_id, key, type, value, epoch)
                SELECT p_run, b.key, b.type, b.value, 0 FROM unnest(p_sdk_keys, p_sdk_types, p_sdk_values) AS b(key, type, value)
                ON CONFLICT (run_id, key) DO NOTHING;
        END IF;
        INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                           context, pending, sdk_state, saved_at, epoch)
            VALUES (p_run, p_key, p_iteration, p_message_count, p_phase, p_schema_version, p_context, p_pending,
                    p_sdk_state, p_saved_at, 0)
            ON CONFLICT (run_id, checkpoint_key) DO NOTHING
            RETURNING checkpoint_id INTO new_id;
        IF new_id IS NULL THEN  -- a retry after a commit whose acknowledgement was lost
            SELECT c.checkpoint_id INTO new_id FROM agentfast_checkpoints c WHERE c.run_id = p_run AND c.checkpoint_key = p_key;
        END IF;
        -- checkpoint_id is one sequence for all runs, so "the last K" is counted per run.
        DELETE FROM agentfast_checkpoints d WHERE d.run_id = p_run AND d.checkpoint_id <
            (SELECT c.checkpoint_id FROM agentfast_checkpoints c WHERE c.run_id = p_run
             ORDER BY c.checkpoint_id DESC OFFSET p_keep - 1 LIMIT 1);
        IF NOT p_read_ends THEN
            RETURN QUERY SELECT new_id, NULL::boolean, NULL::float8, NULL::text, NULL::timestamptz;
            RETURN;
        END IF;
        RETURN QUERY SELECT new_id, r.run_id IS NOT NULL, extract(epoch FROM clock_timestamp() - r.created_at)::float8,
                            q.requested_by, q.requested_at
            FROM (SELECT 1) one LEFT JOIN agentfast_runs r ON r.run_id = p_run
                 LEFT JOIN agentfast_cancel_requests q ON q.run_id = p_run;
    END $$;
    """
    + "".join(
        f"GRANT EXECUTE ON FUNCTION {f} TO agentfast_runner;\n"
        for f in (
            "agentfast_name_lease(bigint, text)",
            "agentfast_save_turn(text, bigint, text, integer, jsonb, integer, integer, jsonb, integer, float8)",
            "agentfast_mark_started(text, bigint, text, integer, integer, float8)",
            "agentfast_record_result(text, bigint, text, integer, integer, jsonb)",
            "agentfast_commit_checkpoint(text, bigint, text, uuid, integer, integer, jsonb, text[], text[], bytea[], integer, text,"
            " integer, jsonb, jsonb, jsonb, bigint, integer, boolean)",
        )
    ),
    # 13: fork and replay (issue 17 item 4): a run made from another's checkpoint (Store.fork_run)
    # records where it came from. Plain columns, not the spec: the spec stays the document the run
    # runs, and provenance is the store's fact. The source's id is text, not a foreign key: the
    # fork keeps its own copies of every row it took, so deleting the source changes nothing.
    """
    ALTER TABLE agentfast_runs ADD COLUMN forked_from text, ADD COLUMN forked_at integer;
    """,
    # 14: a human in the conversation (issue 17 item 3, docs/conversation.md): the user's reply to
    # the model's question is a fourth decision, write-once like the others; its text is `result`.
    """
    ALTER TABLE agentfast_approvals DROP CONSTRAINT agentfast_approvals_decision_check;
    ALTER TABLE agentfast_approvals ADD CONSTRAINT agentfast_approvals_decision_check
        CHECK (decision IN ('approve', 'deny', 'complete', 'reply'));
    """,
    # 15: notifications (issue 18 item 4, docs/notifications.md): one row per awaited call the
    # operator announces to the admin's webhook. The primary key makes "once per call" hold across
    # operator restarts and replicas; a sender claims a due row by moving next_attempt_at past its
    # POST (FOR UPDATE SKIP LOCKED), so two operators never POST the same call at the same time.
    # The operator's alone: runners get no right on it (no GRANT) and row-level security is on.
    """
    CREATE TABLE agentfast_notifications (
        run_id           text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE,
        call_id          text NOT NULL,
        idempotency_key  text NOT NULL,
        event            jsonb NOT NULL,
        state            text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed', 'skipped')),
        attempts         integer NOT NULL DEFAULT 0,
        next_attempt_at  timestamptz NOT NULL DEFAULT now(),
        created_at       timestamptz NOT NULL DEFAULT now(),
        delivered_at     timestamptz,
        last_error       text,
        PRIMARY KEY (run_id, call_id)
    );
    CREATE INDEX agentfast_notifications_due ON agentfast_notifications (next_attempt_at) WHERE state = 'pending';
    ALTER TABLE agentfast_notifications ENABLE ROW LEVEL SECURITY;
    """,
    # 16: trust held by Postgres (issue 30 item 1). A runner role is a hostile tenant's, not a
    # friend's: it may run any SQL its grants allow.
    # - Name resolution: every function of the store gets a pinned search_path (the store's schema,
    #   then pg_temp last: pg_catalog is searched first when unlisted), and the two that act for
    #   other roles (agentfast_tenant, SECURITY DEFINER, which every row-level-security policy
    #   calls; agentfast_fence, the trigger on every runner write) name their tables with the
    #   schema. Before, a runner's TEMP TABLE agentfast_tenants answered another namespace to the
    #   policy (pg_temp came first in the path) and a TEMP TABLE agentfast_runs could fool the fence.
    #   No role but the store's owner may create temporary tables in this database or objects in
    #   this schema (REVOKE from PUBLIC; a store owner who does not own the database gets a
    #   WARNING and keeps only the pinned paths). tests/test_hostile_tenant.py lists every function
    #   in the catalog and fails on any without a pinned search_path.
    # - Locks a tenant cannot squat: advisory locks are one key space every session may take, so
    #   the owner's own serializations (registering a uid, creating or re-keying a namespace's
    #   role) lock a row of agentfast_locks, on which runner roles have no right at all; schema
    #   migrations lock agentfast_migrations in a mode a reader cannot hold (Store.migrate). A
    #   runner's liveness lock gets a fresh random key at each claim, kept in its heartbeat row
    #   (lock_key: its namespace reads it, no other) and counted only when held by the session that
    #   row names (runner/liveness.py): a key seen in pg_locks and taken after its holder died
    #   stalls nothing.
    # - NOTIFY payloads name no run: every run has a random notify_token (readable only by its
    #   namespace and the owner), and agentfast_notify(channel, run_id) sends that instead of the
    #   run id, so a LISTEN on agentfast_progress or agentfast_approval learns no other tenant's
    #   run names (any session may LISTEN on any channel).
    """
    CREATE TABLE agentfast_locks (name text PRIMARY KEY);
    INSERT INTO agentfast_locks VALUES ('tenants'), ('run_uid');
    ALTER TABLE agentfast_locks ENABLE ROW LEVEL SECURITY;

    ALTER TABLE agentfast_runners ADD COLUMN lock_key bigint;
    ALTER TABLE agentfast_runs ADD COLUMN notify_token text NOT NULL DEFAULT md5(gen_random_uuid()::text);
    CREATE INDEX agentfast_runs_notify_token ON agentfast_runs (notify_token);

    CREATE FUNCTION agentfast_notify(p_channel text, p_run text) RETURNS void LANGUAGE sql AS $$
        SELECT pg_notify(p_channel, coalesce((SELECT r.notify_token FROM agentfast_runs r WHERE r.run_id = p_run), ''))
    $$;
    GRANT EXECUTE ON FUNCTION agentfast_notify(text, text) TO agentfast_runner;

    -- Locks: LOCK TABLE in a mode stronger than ROW EXCLUSIVE needs a table-level UPDATE or
    -- DELETE right (column rights do not count), and with it one tenant could lock a table every
    -- tenant's runners use (ACCESS EXCLUSIVE stops them all). So runner roles get column-level
    -- UPDATE only and no DELETE: retention runs in a trigger as the owner, for the run whose
    -- checkpoint the caller was just allowed to insert; a released runner clears its lock_key.
    REVOKE UPDATE, DELETE ON agentfast_tool_calls, agentfast_runners, agentfast_checkpoints FROM agentfast_runner;
    GRANT UPDATE (state, attempts, result, started_at, finished_at, epoch) ON agentfast_tool_calls TO agentfast_runner;
    GRANT UPDATE (runner_id, pid, host, backend_pid, lock_key, started_at, beat_at) ON agentfast_runners TO agentfast_runner;

    -- Retention: the latest agentfast.keep checkpoints of the inserted row's run stay (set by
    -- agentfast_commit_checkpoint in its transaction; unset: no pruning). checkpoint_id is one
    -- sequence for all runs, so "the last K" is counted per run.

    CREATE OR REPLACE FUNCTION agentfast_commit_checkpoint(
        p_run text, p_epoch bigint, p_uid text, p_key uuid, p_iteration integer, p_first_seq integer, p_messages jsonb,
        p_sdk_keys text[], p_sdk_types text[], p_sdk_values bytea[], p_message_count integer, p_phase text,
        p_schema_version integer, p_context jsonb, p_pending jsonb, p_sdk_state jsonb, p_saved_at bigint, p_keep integer,
        p_read_ends boolean)
    RETURNS TABLE (cid bigint, run_found boolean, age_s float8, cancel_by text, cancel_at timestamptz)
    LANGUAGE plpgsql AS $$
    DECLARE
        new_id bigint;
    BEGIN
        PERFORM agentfast_name_lease(p_epoch, p_uid);
        PERFORM set_config('agentfast.keep', p_keep::text, true);  -- retention: agentfast_prune, after the insert
        IF p_messages IS NOT NULL THEN
            INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch)
                SELECT p_run, p_first_seq + m.i - 1, p_iteration, m.message, 0
                FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS m(message, i)
                ON CONFLICT (run_id, seq) DO NOTHING;
        END IF;
        IF cardinality(p_sdk_keys) > 0 THEN
            INSERT INTO agentfast_sdk_blobs (run_id, key, type, value, epoch)
                SELECT p_run, b.key, b.type, b.value, 0 FROM unnest(p_sdk_keys, p_sdk_types, p_sdk_values) AS b(key, type, value)
                ON CONFLICT (run_id, key) DO NOTHING;
        END IF;
        INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                           context, pending, sdk_state, saved_at, epoch)
            VALUES (p_run, p_key, p_iteration, p_message_count, p_phase, p_schema_version, p_context, p_pending,
                    p_sdk_state, p_saved_at, 0)
            ON CONFLICT (run_id, checkpoint_key) DO NOTHING
            RETURNING checkpoint_id INTO new_id;
        IF new_id IS NULL THEN  -- a retry after a commit whose acknowledgement was lost
            SELECT c.checkpoint_id INTO new_id FROM agentfast_checkpoints c WHERE c.run_id = p_run AND c.checkpoint_key = p_key;
        END IF;
        IF NOT p_read_ends THEN
            RETURN QUERY SELECT new_id, NULL::boolean, NULL::float8, NULL::text, NULL::timestamptz;
            RETURN;
        END IF;
        RETURN QUERY SELECT new_id, r.run_id IS NOT NULL, extract(epoch FROM clock_timestamp() - r.created_at)::float8,
                            q.requested_by, q.requested_at
            FROM (SELECT 1) one LEFT JOIN agentfast_runs r ON r.run_id = p_run
                 LEFT JOIN agentfast_cancel_requests q ON q.run_id = p_run;
    END $$;

    DO $migration$
    DECLARE
        s text := current_schema();
        f regprocedure;
    BEGIN
        EXECUTE format($f$
            CREATE OR REPLACE FUNCTION %1$I.agentfast_tenant() RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
                SET search_path = %1$I, pg_temp
                AS $body$ SELECT t.namespace FROM %1$I.agentfast_tenants t WHERE t.role_name = session_user $body$
        $f$, s);
        EXECUTE format($f$
            CREATE OR REPLACE FUNCTION %1$I.agentfast_fence() RETURNS trigger LANGUAGE plpgsql
                SET search_path = %1$I, pg_temp
                AS $body$
            DECLARE
                mine text := current_setting('agentfast.epoch', true);
                mine_uid text := current_setting('agentfast.run_uid', true);
                cur bigint;
                cur_uid text;
            BEGIN
                SELECT r.epoch, r.run_uid INTO cur, cur_uid FROM %1$I.agentfast_runs r WHERE r.run_id = NEW.run_id FOR SHARE;
                IF mine IS NULL OR mine = '' THEN
                    RAISE EXCEPTION 'agentfast: write to %% for run %% without a lease (agentfast.epoch unset)', TG_TABLE_NAME, NEW.run_id
                        USING ERRCODE = 'AF001';
                END IF;
                IF cur IS NULL OR mine::bigint <> cur THEN
                    RAISE EXCEPTION 'agentfast: run %% lease lost: epoch %% is stale (current %%)', NEW.run_id, mine, cur
                        USING ERRCODE = 'AF001';
                END IF;
                IF coalesce(mine_uid, '') <> '' AND mine_uid <> cur_uid THEN
                    RAISE EXCEPTION 'agentfast: run %% lease lost: the run was replaced: uid mismatch (lease uid %%, run uid %%)',
                        NEW.run_id, mine_uid, cur_uid
                        USING ERRCODE = 'AF001';
                END IF;
                NEW.epoch := cur;
                RETURN NEW;
            END $body$
        $f$, s);
        EXECUTE format($f$
            CREATE FUNCTION %1$I.agentfast_prune() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
                SET search_path = %1$I, pg_temp
                AS $body$
            DECLARE
                keep integer := nullif(current_setting('agentfast.keep', true), '')::integer;
            BEGIN
                IF keep IS NOT NULL THEN
                    DELETE FROM %1$I.agentfast_checkpoints d WHERE d.run_id = NEW.run_id AND d.checkpoint_id <
                        (SELECT c.checkpoint_id FROM %1$I.agentfast_checkpoints c WHERE c.run_id = NEW.run_id
                         ORDER BY c.checkpoint_id DESC OFFSET keep - 1 LIMIT 1);
                END IF;
                RETURN NULL;
            END $body$
        $f$, s);
        EXECUTE format('CREATE TRIGGER agentfast_prune AFTER INSERT ON %I.agentfast_checkpoints'
                       ' FOR EACH ROW EXECUTE FUNCTION %I.agentfast_prune()', s, s);
        FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
                 WHERE p.pronamespace = s::regnamespace AND p.proname LIKE 'agentfast\\_%' LOOP
            EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, s);
        END LOOP;
        -- Only the owner creates temporary tables here, or objects in the schema.
        EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
        EXECUTE format('GRANT TEMPORARY ON DATABASE %I TO %I', current_database(), current_user);
        EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', s);
    END $migration$;
    """,
    # 17: a decision bound to what its decider saw (G13, issue 30 items 1 and 8): the digest of
    # the call's arguments as shown (runner/arguments.py), stored with the decision; the runner
    # runs an approved call only when its arguments still have that digest. NULL only on rows
    # decided before this migration (runner/loop.py: they apply as they did).
    """
    ALTER TABLE agentfast_approvals ADD COLUMN arguments_digest text
        CHECK (arguments_digest IS NULL OR arguments_digest ~ '^sha256:[0-9a-f]{64}$');
    """,
    # 18: crash loops (issue 30 item 4): an iteration that has crashed its runner N times in a row
    # ends the run Failed (reason CrashLoop), never an endless exit 75 and restart. One row per run:
    # the iteration the last runner started at, how many runners crashed in it (died without a
    # graceful end: SIGKILL, os._exit, the tool host's death) and whether an attempt is running
    # now. agentfast_start_attempt, called by each runner at its takeover, counts the previous
    # attempt as a crash of this iteration if it never ended (its last commit is the checkpoint
    # this one starts from, so it died in this very iteration); agentfast_end_attempt, called at a
    # graceful end, clears the flag. The count is per iteration: a start at a later iteration (the
    # earlier one committed) starts again from 0. Fenced like every table a runner writes; runner
    # roles reach their namespace's rows only (row-level security), and get column-level UPDATE
    # only, no DELETE (migration 16's rule).
    """
    CREATE TABLE agentfast_attempts (
        run_id      text PRIMARY KEY REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE,
        iteration   integer NOT NULL,
        crashes     integer NOT NULL DEFAULT 0,
        running     boolean NOT NULL DEFAULT false,
        epoch       bigint NOT NULL,
        updated_at  timestamptz NOT NULL DEFAULT now()
    );
    CREATE TRIGGER agentfast_fence BEFORE INSERT OR UPDATE ON agentfast_attempts
        FOR EACH ROW EXECUTE FUNCTION agentfast_fence();
    ALTER TABLE agentfast_attempts ENABLE ROW LEVEL SECURITY;
    CREATE POLICY agentfast_tenant ON agentfast_attempts TO agentfast_runner
        USING (split_part(run_id, '/', 1) = agentfast_tenant());
    GRANT SELECT, INSERT ON agentfast_attempts TO agentfast_runner;
    GRANT UPDATE (iteration, crashes, running, epoch, updated_at) ON agentfast_attempts TO agentfast_runner;

    DO $migration$
    DECLARE
        s text := current_schema();
    BEGIN
        -- An attempt of p_iteration starts: returns how many attempts of it crashed before this one.
        EXECUTE format($f$
            CREATE FUNCTION %1$I.agentfast_start_attempt(p_run text, p_epoch bigint, p_uid text, p_iteration integer)
            RETURNS integer LANGUAGE plpgsql SET search_path = %1$I, pg_temp AS $body$
            DECLARE
                n integer;
            BEGIN
                PERFORM %1$I.agentfast_name_lease(p_epoch, p_uid);
                INSERT INTO %1$I.agentfast_attempts AS a (run_id, iteration, crashes, running, epoch)
                    VALUES (p_run, p_iteration, 0, true, 0)
                    ON CONFLICT (run_id) DO UPDATE SET
                        crashes = (CASE WHEN a.iteration = p_iteration THEN a.crashes ELSE 0 END)
                                  + (CASE WHEN a.running THEN 1 ELSE 0 END),
                        iteration = p_iteration, running = true, updated_at = now()
                    RETURNING a.crashes INTO n;
                RETURN n;
            END $body$
        $f$, s);
        -- The attempt ended gracefully at p_iteration (not a crash).
        EXECUTE format($f$
            CREATE FUNCTION %1$I.agentfast_end_attempt(p_run text, p_epoch bigint, p_uid text, p_iteration integer)
            RETURNS void LANGUAGE plpgsql SET search_path = %1$I, pg_temp AS $body$
            BEGIN
                PERFORM %1$I.agentfast_name_lease(p_epoch, p_uid);
                UPDATE %1$I.agentfast_attempts a SET running = false,
                       crashes = CASE WHEN a.iteration = p_iteration THEN a.crashes ELSE 0 END,
                       iteration = p_iteration, updated_at = now()
                    WHERE a.run_id = p_run;
            END $body$
        $f$, s);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %1$I.agentfast_start_attempt(text, bigint, text, integer) TO agentfast_runner', s);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %1$I.agentfast_end_attempt(text, bigint, text, integer) TO agentfast_runner', s);
    END $migration$;
    """,
    # 19: every model reply the endpoint answered is counted (issue 30 item 4, issue 31 item 4).
    # A reply's usage is recorded the moment it arrives, before anything that can crash
    # (Store.record_reply: one statement, committed asynchronously), one row per (run, iteration,
    # epoch): a runner asks the model at most once per iteration and lease. The turn that keeps
    # the reply (agentfast_turns, saved by the same lease) marks it kept, in its own insert
    # (trigger, as the owner: runner roles get no UPDATE here). A reply never kept was answered
    # and paid for and then lost to a crash; readers add those to the checkpoint's usage (which
    # counts saved turns only), so each reply is counted exactly once: through its turn, or as lost.
    # No fence: a zombie's reply was paid for too. Its run is found by uid (an archived run's
    # rows follow its rename), preferring p_run.
    """
    CREATE TABLE agentfast_model_replies (
        run_id             text NOT NULL REFERENCES agentfast_runs ON DELETE CASCADE ON UPDATE CASCADE,
        iteration          integer NOT NULL,
        epoch              bigint NOT NULL,
        prompt_tokens      integer NOT NULL CHECK (prompt_tokens >= 0),
        completion_tokens  integer NOT NULL CHECK (completion_tokens >= 0),
        cost               float8,
        kept               boolean NOT NULL DEFAULT false,
        created_at         timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (run_id, iteration, epoch)
    );
    CREATE INDEX agentfast_model_replies_lost ON agentfast_model_replies (run_id) WHERE NOT kept;
    ALTER TABLE agentfast_model_replies ENABLE ROW LEVEL SECURITY;
    CREATE POLICY agentfast_tenant ON agentfast_model_replies TO agentfast_runner
        USING (split_part(run_id, '/', 1) = agentfast_tenant());
    GRANT SELECT, INSERT ON agentfast_model_replies TO agentfast_runner;

    DO $migration$
    DECLARE
        s text := current_schema();
    BEGIN
        EXECUTE format($f$
            CREATE FUNCTION %1$I.agentfast_record_reply(p_run text, p_epoch bigint, p_uid text, p_iteration integer,
                                                        p_prompt_tokens integer, p_completion_tokens integer, p_cost float8)
            RETURNS void LANGUAGE sql
                SET search_path = %1$I, pg_temp
                AS $body$
            INSERT INTO %1$I.agentfast_model_replies (run_id, iteration, epoch, prompt_tokens, completion_tokens, cost)
                SELECT r.run_id, p_iteration, p_epoch, p_prompt_tokens, p_completion_tokens, p_cost
                FROM %1$I.agentfast_runs r WHERE r.run_uid = p_uid
                ORDER BY r.run_id = p_run DESC LIMIT 1
                ON CONFLICT (run_id, iteration, epoch) DO NOTHING
            $body$
        $f$, s);
        EXECUTE format($f$
            CREATE FUNCTION %1$I.agentfast_reply_kept() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
                SET search_path = %1$I, pg_temp
                AS $body$
            BEGIN
                UPDATE %1$I.agentfast_model_replies m SET kept = true
                    WHERE m.run_id = NEW.run_id AND m.iteration = NEW.iteration AND m.epoch = NEW.epoch AND NOT m.kept;
                RETURN NULL;
            END $body$
        $f$, s);
        EXECUTE format('CREATE TRIGGER agentfast_reply_kept AFTER INSERT ON %I.agentfast_turns'
                       ' FOR EACH ROW EXECUTE FUNCTION %I.agentfast_reply_kept()', s, s);
        EXECUTE format('REVOKE ALL ON FUNCTION %I.agentfast_record_reply(text, bigint, text, integer, integer, integer, float8)'
                       ' FROM PUBLIC', s);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.agentfast_record_reply(text, bigint, text, integer, integer, integer, float8)'
                       ' TO agentfast_runner', s);
        EXECUTE format('REVOKE ALL ON FUNCTION %I.agentfast_reply_kept() FROM PUBLIC', s);
    END $migration$;
    """,
    # 20: a conversation as people have one (issue 31 item 1, docs/conversation.md): the person
    # ends the conversation with a fifth decision on the question that awaits them, `end`,
    # write-once and attributed like a reply (agentfast end, an `end: true` entry of spec.replies).
    """
    ALTER TABLE agentfast_approvals DROP CONSTRAINT agentfast_approvals_decision_check;
    ALTER TABLE agentfast_approvals ADD CONSTRAINT agentfast_approvals_decision_check
        CHECK (decision IN ('approve', 'deny', 'complete', 'reply', 'end'));
    """,
]
