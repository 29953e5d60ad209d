// Formatting of sizes, rates, durations and times.

export function bytes(n) {
  if (n === null || n === undefined) return '';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let v = Number(n);
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${i === 0 ? v : v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

export function rate(bps) {
  return bps ? `${bytes(bps)}/s` : '';
}

export function duration(ms) {
  if (ms === null || ms === undefined) return '';
  const s = Math.max(0, Math.round(ms / 1000));
  if (ms < 10000) return `${(ms / 1000).toFixed(1)}s`;
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const h = Math.floor(m / 60);
  return `${h}h ${m % 60}m`;
}

export function eta(seconds) {
  return seconds === null || seconds === undefined ? '' : `ETA ${duration(seconds * 1000)}`;
}

export function ago(iso) {
  if (!iso) return '';
  const ms = Date.now() - new Date(iso).getTime();
  return ms < 1500 ? 'just now' : `${duration(ms)} ago`;
}

export function time(iso) {
  if (!iso) return '';
  const d = new Date(iso);
  return d.toLocaleString(undefined, { hour12: false });
}
