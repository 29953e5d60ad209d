//! `shardline server --http ADDR`: the HTTP API, the dashboard and `/metrics` next to the reaper, and
//! `shardline token create|list|revoke` for the API tokens they accept.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shardline_metrics::Metrics;
use shardline_spec::policy::PathPolicy;
use shardline_store::Store;
use shardline_web::{AppState, AuthMode, Scope};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::orchestrate::StateArgs;

/// The HTTP options of `shardline server`.
#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// Serve the HTTP API (/api/v1) and the dashboard (/) on this address, e.g. 127.0.0.1:8080
    /// (port 0 picks a free port; the address is printed).
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Let anyone who reaches the address read runs, logs and workers without a token
    /// (submitting, cancelling and retrying always need one).
    #[arg(long, requires = "http", conflicts_with = "require_read_token")]
    pub public_reads: bool,
    /// Reads need a token of scope `read` or higher too (the default).
    #[arg(long, requires = "http")]
    pub require_read_token: bool,
}

impl HttpArgs {
    fn auth(&self) -> AuthMode {
        if self.public_reads {
            AuthMode::Open
        } else {
            AuthMode::ReadRequiresToken
        }
    }
}

/// The path policy of `shardline server`: what specs submitted through the API and fired by
/// triggers may name.
#[derive(Args, Clone, Debug, Default)]
pub struct PolicyArgs {
    /// A directory or URL prefix specs may read sources from (repeatable; `s3://bucket/releases`,
    /// `/data/releases`). With any of these flags, a spec naming anything outside them is refused.
    #[arg(long = "allow-source", value_name = "DIR|URL", env = "SHARDLINE_ALLOW_SOURCE", value_delimiter = ',')]
    pub sources: Vec<String>,
    /// A directory or URL prefix specs may write results to (repeatable).
    #[arg(long = "allow-dest", value_name = "DIR|URL", env = "SHARDLINE_ALLOW_DEST", value_delimiter = ',')]
    pub dests: Vec<String>,
    /// Under a policy (any --allow-source or --allow-dest), also let specs run `uses: command`
    /// steps; without a policy they may anyway.
    #[arg(long = "allow-commands")]
    pub commands: bool,
}

impl PolicyArgs {
    /// The policy, when a root is given.
    pub fn policy(&self) -> Result<Option<Arc<PathPolicy>>> {
        if self.sources.is_empty() && self.dests.is_empty() {
            return Ok(None);
        }
        let policy = shardline_control::policy::policy_from_flags(&self.sources, &self.dests, self.commands)
            .map_err(|e| anyhow::anyhow!("the path policy: {e}"))?;
        Ok(Some(Arc::new(policy)))
    }
}

/// Binds `--http` (when given) and serves the API and the dashboard until `stop` turns true.
/// Binding happens before this returns, so a taken port is an error of the command; the bound
/// address is returned with the server's task.
pub async fn start_http(
    args: &HttpArgs,
    store: &Store,
    metrics: &Arc<Metrics>,
    policy: Option<Arc<PathPolicy>>,
    work_dir: PathBuf,
    artifacts: Option<String>,
    stop: watch::Receiver<bool>,
) -> Result<Option<(JoinHandle<()>, SocketAddr)>> {
    let Some(addr) = args.http else { return Ok(None) };
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the HTTP address {addr}"))?;
    let bound = listener.local_addr().context("reading the bound HTTP address")?;
    let mut state = AppState::new(store.clone()).with_auth(args.auth());
    state.base_dir = std::env::current_dir().context("reading the current directory")?;
    state.work_dir = work_dir;
    state.artifacts = artifacts;
    state.metrics = Some(metrics.clone());
    if policy.is_none() {
        eprintln!(
            "server: no path policy: specs submitted through the API may read and write anywhere the workers can \
             (--allow-source, --allow-dest)"
        );
    }
    state.policy = policy;
    eprintln!(
        "server: dashboard and API on http://{bound}/ ({})",
        match args.auth() {
            AuthMode::Open => "reads are public; changes need a token",
            AuthMode::ReadRequiresToken => "every request needs a token: shardline token create --scope read",
        }
    );
    let handle = tokio::spawn(async move {
        if let Err(e) = shardline_web::serve_on(listener, state, stop).await {
            eprintln!("server: the HTTP server stopped: {e}");
        }
    });
    Ok(Some((handle, bound)))
}

#[derive(Args, Debug)]
pub struct TokenArgs {
    #[command(subcommand)]
    pub command: TokenCommand,
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Create a token; its secret is printed once (on stdout) and only its hash is kept.
    Create {
        /// read (see everything), submit (also start runs), admin (also cancel and retry).
        #[arg(long, value_parser = parse_scope)]
        scope: Scope,
        /// Who or what uses it (shown by `token list` and in refusals).
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        state: StateArgs,
    },
    /// List tokens (never their secrets).
    List {
        #[command(flatten)]
        state: StateArgs,
    },
    /// Revoke a token by id: requests with it are refused from now on.
    Revoke {
        id: i64,
        #[command(flatten)]
        state: StateArgs,
    },
}

fn parse_scope(s: &str) -> Result<Scope, String> {
    s.parse()
}

pub fn run_token(args: TokenArgs) -> Result<ExitCode> {
    crate::orchestrate::runtime()?.block_on(async move {
        match args.command {
            TokenCommand::Create { scope, name, state } => {
                let store = state.store().await?;
                let name = name.unwrap_or_else(|| format!("{scope} token"));
                if name.trim().is_empty() {
                    bail!("--name must not be empty");
                }
                let token =
                    shardline_web::auth::create_token(&store, &name, scope).await.context("creating the token")?;
                eprintln!("token {} `{name}` (scope {scope}) created; this is the only time it is shown:", token.id);
                println!("{}", token.secret);
                Ok(ExitCode::SUCCESS)
            }
            TokenCommand::List { state } => {
                let store = state.store().await?;
                let tokens = shardline_web::auth::list_tokens(&store).await.context("listing tokens")?;
                println!("{:>5}  {:<7} {:<24} {:<20} revoked", "id", "scope", "name", "created");
                for t in tokens {
                    println!(
                        "{:>5}  {:<7} {:<24} {:<20} {}",
                        t.id,
                        t.scope,
                        t.name,
                        t.created_at.format("%Y-%m-%d %H:%M:%S"),
                        t.revoked_at.map(|r| r.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_else(|| "-".into())
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            TokenCommand::Revoke { id, state } => {
                let store = state.store().await?;
                if shardline_web::auth::revoke_token(&store, id).await.context("revoking the token")? {
                    println!("token {id} revoked");
                    Ok(ExitCode::SUCCESS)
                } else {
                    eprintln!("there is no unrevoked token {id}");
                    Ok(ExitCode::from(1))
                }
            }
        }
    })
}
