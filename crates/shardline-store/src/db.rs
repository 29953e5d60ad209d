//! One way of running SQL on either backend.
//!
//! Queries are written once with `$N` parameters (both PostgreSQL and SQLite accept them) and a
//! few tokens for what differs, rendered per backend once per call site by [`sql!`]:
//!
//! | token | PostgreSQL | SQLite |
//! |---|---|---|
//! | `{now}` | `now()` (timestamptz) | `unixepoch('subsec')` in integer milliseconds |
//! | `{ms:X}` | `(X * interval '1 millisecond')` | `(X)` |
//! | `{skip_locked}` | `FOR UPDATE SKIP LOCKED` | nothing: writers are serialized |
//! | `{for_update}` / `{for_share}` | `FOR UPDATE` / `FOR SHARE` | nothing |
//! | `{ids:X}` | `(SELECT jsonb_array_elements_text(X)::bigint)` | `(SELECT value FROM json_each(X))` |
//! | `{lock:T}` (a statement) | `LOCK TABLE T IN SHARE ROW EXCLUSIVE MODE` | `SELECT 1`: writers are serialized |
//! | `{strs:X}` | `(SELECT jsonb_array_elements_text(X))` | `(SELECT value FROM json_each(X))` |
//!
//! Rows decode through `sqlx::FromRow` into records that work for both backends: integers are
//! `BIGINT`/`INTEGER` (`i64`), JSON is `JSONB`/`TEXT` (`Json<Value>`), times are
//! `timestamptz`/integer milliseconds ([`DbTime`]).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::error::BoxDynError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgRow, PgTypeInfo, PgValueRef};
use sqlx::query::{Query, QueryAs};
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqliteRow, SqliteTypeInfo, SqliteValueRef};
use sqlx::types::Json;
use sqlx::{Decode, FromRow, PgPool, Postgres, Sqlite, SqlitePool, Type};

use crate::types::Backend;

/// A query rendered for both backends.
pub(crate) struct Sql {
    pg: String,
    lite: String,
}

impl Sql {
    pub(crate) fn render(text: &str) -> Sql {
        Sql { pg: render(text, Backend::Postgres), lite: render(text, Backend::Sqlite) }
    }

    pub(crate) fn pair(pg: &str, lite: &str) -> Sql {
        Sql { pg: render(pg, Backend::Postgres), lite: render(lite, Backend::Sqlite) }
    }

    fn get(&self, backend: Backend) -> &str {
        match backend {
            Backend::Postgres => &self.pg,
            Backend::Sqlite => &self.lite,
        }
    }
}

/// `sql!("…")`: the same text for both backends; `sql!(pg: "…", lite: "…")`: one each.
/// Rendered once per call site.
macro_rules! sql {
    ($text:expr) => {{
        static CELL: ::std::sync::OnceLock<$crate::db::Sql> = ::std::sync::OnceLock::new();
        CELL.get_or_init(|| $crate::db::Sql::render($text))
    }};
    (pg: $pg:expr, lite: $lite:expr) => {{
        static CELL: ::std::sync::OnceLock<$crate::db::Sql> = ::std::sync::OnceLock::new();
        CELL.get_or_init(|| $crate::db::Sql::pair($pg, $lite))
    }};
}
pub(crate) use sql;

/// `args![a, b, …]`: query arguments, each converted with `Arg::from`.
macro_rules! args {
    ($($a:expr),* $(,)?) => { vec![$($crate::db::Arg::from($a)),*] };
}
pub(crate) use args;

fn render(text: &str, backend: Backend) -> String {
    let pg = backend == Backend::Postgres;
    let mut out = String::with_capacity(text.len() + 64);
    let mut rest = text;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            rest = "";
            break;
        };
        let token = &after[..end];
        let (name, arg) = match token.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (token, None),
        };
        let replaced = match (name, arg, pg) {
            ("now", None, true) => "now()".to_string(),
            ("now", None, false) => "(CAST(unixepoch('subsec') * 1000 AS INTEGER))".to_string(),
            ("ms", Some(x), true) => format!("({x} * interval '1 millisecond')"),
            ("ms", Some(x), false) => format!("({x})"),
            ("skip_locked", None, true) => "FOR UPDATE SKIP LOCKED".to_string(),
            ("for_update", None, true) => "FOR UPDATE".to_string(),
            ("for_share", None, true) => "FOR SHARE".to_string(),
            ("skip_locked" | "for_update" | "for_share", None, false) => String::new(),
            // Serializes the transactions that replace a table's rows; readers are not blocked.
            ("lock", Some(t), true) => format!("LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE"),
            ("lock", Some(_), false) => "SELECT 1".to_string(),
            ("ids", Some(x), true) => format!("(SELECT jsonb_array_elements_text({x})::bigint)"),
            ("strs", Some(x), true) => format!("(SELECT jsonb_array_elements_text({x}))"),
            ("ids" | "strs", Some(x), false) => format!("(SELECT value FROM json_each({x}))"),
            // Not a token (JSON path, literal brace): keep as is.
            _ => format!("{{{token}}}"),
        };
        out.push_str(&replaced);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

/// A query argument.
#[derive(Debug, Clone)]
pub(crate) enum Arg {
    Bool(bool),
    I64(i64),
    OptI64(Option<i64>),
    Text(String),
    OptText(Option<String>),
    Json(Value),
    OptJson(Option<Value>),
    Time(DateTime<Utc>),
    OptTime(Option<DateTime<Utc>>),
}

impl From<bool> for Arg {
    fn from(v: bool) -> Arg {
        Arg::Bool(v)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Arg {
        Arg::I64(v)
    }
}
impl From<Option<i64>> for Arg {
    fn from(v: Option<i64>) -> Arg {
        Arg::OptI64(v)
    }
}
impl From<String> for Arg {
    fn from(v: String) -> Arg {
        Arg::Text(v)
    }
}
impl From<&str> for Arg {
    fn from(v: &str) -> Arg {
        Arg::Text(v.to_string())
    }
}
impl From<&String> for Arg {
    fn from(v: &String) -> Arg {
        Arg::Text(v.clone())
    }
}
impl From<Option<String>> for Arg {
    fn from(v: Option<String>) -> Arg {
        Arg::OptText(v)
    }
}
impl From<Option<&str>> for Arg {
    fn from(v: Option<&str>) -> Arg {
        Arg::OptText(v.map(str::to_string))
    }
}
impl From<Value> for Arg {
    fn from(v: Value) -> Arg {
        Arg::Json(v)
    }
}
impl From<&Value> for Arg {
    fn from(v: &Value) -> Arg {
        Arg::Json(v.clone())
    }
}
impl From<Option<Value>> for Arg {
    fn from(v: Option<Value>) -> Arg {
        Arg::OptJson(v)
    }
}
impl From<DateTime<Utc>> for Arg {
    fn from(v: DateTime<Utc>) -> Arg {
        Arg::Time(v)
    }
}
impl From<Option<DateTime<Utc>>> for Arg {
    fn from(v: Option<DateTime<Utc>>) -> Arg {
        Arg::OptTime(v)
    }
}

macro_rules! bind_all {
    ($q:expr, $args:expr, $backend:ident) => {{
        let mut q = $q;
        for a in $args {
            q = match a {
                Arg::Bool(v) => q.bind(v),
                Arg::I64(v) => q.bind(v),
                Arg::OptI64(v) => q.bind(v),
                Arg::Text(v) => q.bind(v),
                Arg::OptText(v) => q.bind(v),
                Arg::Json(v) => q.bind(Json(v)),
                Arg::OptJson(v) => q.bind(v.map(Json)),
                Arg::Time(v) => bind_all!(@time q, v, $backend),
                Arg::OptTime(v) => bind_all!(@opt_time q, v, $backend),
            };
        }
        q
    }};
    (@time $q:ident, $v:ident, pg) => { $q.bind($v) };
    (@time $q:ident, $v:ident, lite) => { $q.bind($v.timestamp_millis()) };
    (@opt_time $q:ident, $v:ident, pg) => { $q.bind($v) };
    (@opt_time $q:ident, $v:ident, lite) => { $q.bind($v.map(|t| t.timestamp_millis())) };
}

fn bind_pg(q: Query<'_, Postgres, PgArguments>, args: Vec<Arg>) -> Query<'_, Postgres, PgArguments> {
    bind_all!(q, args, pg)
}
fn bind_pg_as<O>(q: QueryAs<'_, Postgres, O, PgArguments>, args: Vec<Arg>) -> QueryAs<'_, Postgres, O, PgArguments> {
    bind_all!(q, args, pg)
}
fn bind_lite<'q>(q: Query<'q, Sqlite, SqliteArguments<'q>>, args: Vec<Arg>) -> Query<'q, Sqlite, SqliteArguments<'q>> {
    bind_all!(q, args, lite)
}
fn bind_lite_as<'q, O>(
    q: QueryAs<'q, Sqlite, O, SqliteArguments<'q>>,
    args: Vec<Arg>,
) -> QueryAs<'q, Sqlite, O, SqliteArguments<'q>> {
    bind_all!(q, args, lite)
}

/// A row type that decodes from both backends.
pub(crate) trait Rec: for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, SqliteRow> + Send + Unpin {}
impl<T> Rec for T where T: for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, SqliteRow> + Send + Unpin {}

/// A borrowed connection (pooled or inside a transaction) of either backend.
pub(crate) enum Conn<'c> {
    Pg(&'c mut PgConnection),
    Lite(&'c mut SqliteConnection),
}

impl Conn<'_> {
    /// Runs a statement; returns the rows affected.
    pub(crate) async fn exec(&mut self, sql: &'static Sql, args: Vec<Arg>) -> Result<u64, sqlx::Error> {
        match self {
            Conn::Pg(c) => {
                let q = bind_pg(sqlx::query(sql.get(Backend::Postgres)), args);
                Ok(q.execute(&mut **c).await?.rows_affected())
            }
            Conn::Lite(c) => {
                let q = bind_lite(sqlx::query(sql.get(Backend::Sqlite)), args);
                Ok(q.execute(&mut **c).await?.rows_affected())
            }
        }
    }

    pub(crate) async fn all<T: Rec>(&mut self, sql: &'static Sql, args: Vec<Arg>) -> Result<Vec<T>, sqlx::Error> {
        match self {
            Conn::Pg(c) => {
                let q = bind_pg_as(sqlx::query_as::<Postgres, T>(sql.get(Backend::Postgres)), args);
                q.fetch_all(&mut **c).await
            }
            Conn::Lite(c) => {
                let q = bind_lite_as(sqlx::query_as::<Sqlite, T>(sql.get(Backend::Sqlite)), args);
                q.fetch_all(&mut **c).await
            }
        }
    }

    pub(crate) async fn opt<T: Rec>(&mut self, sql: &'static Sql, args: Vec<Arg>) -> Result<Option<T>, sqlx::Error> {
        match self {
            Conn::Pg(c) => {
                let q = bind_pg_as(sqlx::query_as::<Postgres, T>(sql.get(Backend::Postgres)), args);
                q.fetch_optional(&mut **c).await
            }
            Conn::Lite(c) => {
                let q = bind_lite_as(sqlx::query_as::<Sqlite, T>(sql.get(Backend::Sqlite)), args);
                q.fetch_optional(&mut **c).await
            }
        }
    }

    pub(crate) async fn one<T: Rec>(&mut self, sql: &'static Sql, args: Vec<Arg>) -> Result<T, sqlx::Error> {
        match self.opt(sql, args).await? {
            Some(row) => Ok(row),
            None => Err(sqlx::Error::RowNotFound),
        }
    }
}

/// A pool of either backend.
#[derive(Clone)]
pub(crate) enum Pool {
    Pg(PgPool),
    Lite(SqlitePool),
}

impl Pool {
    pub(crate) fn backend(&self) -> Backend {
        match self {
            Pool::Pg(_) => Backend::Postgres,
            Pool::Lite(_) => Backend::Sqlite,
        }
    }

    pub(crate) async fn acquire(&self) -> Result<PoolConn, sqlx::Error> {
        Ok(match self {
            Pool::Pg(p) => PoolConn::Pg(p.acquire().await?),
            Pool::Lite(p) => PoolConn::Lite(p.acquire().await?),
        })
    }

    /// A write transaction. SQLite takes the write lock up front (`BEGIN IMMEDIATE`), so two
    /// writers queue on the busy timeout instead of failing to upgrade a read lock.
    pub(crate) async fn begin(&self) -> Result<Tx<'static>, sqlx::Error> {
        Ok(match self {
            Pool::Pg(p) => Tx::Pg(p.begin().await?),
            Pool::Lite(p) => Tx::Lite(p.begin_with("BEGIN IMMEDIATE").await?),
        })
    }

    pub(crate) async fn close(&self) {
        match self {
            Pool::Pg(p) => p.close().await,
            Pool::Lite(p) => p.close().await,
        }
    }
}

pub(crate) enum PoolConn {
    Pg(PoolConnection<Postgres>),
    Lite(PoolConnection<Sqlite>),
}

impl PoolConn {
    pub(crate) fn conn(&mut self) -> Conn<'_> {
        match self {
            PoolConn::Pg(c) => Conn::Pg(c),
            PoolConn::Lite(c) => Conn::Lite(c),
        }
    }

    /// A write transaction on this connection (which stays ours after the commit).
    pub(crate) async fn begin(&mut self) -> Result<Tx<'_>, sqlx::Error> {
        use sqlx::Connection;
        Ok(match self {
            PoolConn::Pg(c) => Tx::Pg((**c).begin().await?),
            PoolConn::Lite(c) => Tx::Lite((**c).begin_with("BEGIN IMMEDIATE").await?),
        })
    }
}

pub(crate) enum Tx<'c> {
    Pg(sqlx::Transaction<'c, Postgres>),
    Lite(sqlx::Transaction<'c, Sqlite>),
}

impl Tx<'_> {
    pub(crate) fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Pg(t) => Conn::Pg(t),
            Tx::Lite(t) => Conn::Lite(t),
        }
    }

    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Pg(t) => t.commit().await,
            Tx::Lite(t) => t.commit().await,
        }
    }

    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Pg(t) => t.rollback().await,
            Tx::Lite(t) => t.rollback().await,
        }
    }

    /// Ends the transaction by `result`: commits an `Ok`, rolls an `Err` back and waits for it.
    /// A transaction merely dropped is rolled back only when its connection is next used, so the
    /// row locks of a refused operation would outlive the call, and a claim (`SKIP LOCKED`)
    /// right after it would not see the rows it had locked.
    pub(crate) async fn finish<T, E: From<sqlx::Error>>(self, result: Result<T, E>) -> Result<T, E> {
        match result {
            Ok(v) => {
                self.commit().await?;
                Ok(v)
            }
            Err(e) => {
                // The operation's own error is the one to report; a failed rollback leaves the
                // connection to sqlx, which discards it.
                let _ = self.rollback().await;
                Err(e)
            }
        }
    }
}

/// A point in time as stored: `timestamptz` on PostgreSQL, integer milliseconds on SQLite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DbTime(pub(crate) DateTime<Utc>);

impl Type<Postgres> for DbTime {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for DbTime {
    fn decode(value: PgValueRef<'r>) -> Result<DbTime, BoxDynError> {
        <DateTime<Utc> as Decode<'r, Postgres>>::decode(value).map(DbTime)
    }
}

impl Type<Sqlite> for DbTime {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }
    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <i64 as Type<Sqlite>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Sqlite> for DbTime {
    fn decode(value: SqliteValueRef<'r>) -> Result<DbTime, BoxDynError> {
        let ms = <i64 as Decode<'r, Sqlite>>::decode(value)?;
        DateTime::from_timestamp_millis(ms)
            .map(DbTime)
            .ok_or_else(|| format!("timestamp of {ms} ms since the epoch is out of range").into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_render_per_backend() {
        let text = "UPDATE t SET a = {now} + {ms:$2} WHERE id IN {ids:$1} {skip_locked} -> '{$.x}'";
        assert_eq!(
            render(text, Backend::Postgres),
            "UPDATE t SET a = now() + ($2 * interval '1 millisecond') WHERE id IN \
             (SELECT jsonb_array_elements_text($1)::bigint) FOR UPDATE SKIP LOCKED -> '{$.x}'"
        );
        assert_eq!(
            render(text, Backend::Sqlite),
            "UPDATE t SET a = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) + ($2) WHERE id IN \
             (SELECT value FROM json_each($1))  -> '{$.x}'"
        );
    }
}
