// Loads the stored records of a run before the live stream takes over.
//
// A small run is read whole (pages of PAGE records). A large one (more than RAW_LIMIT records,
// almost all of them `stagehand/block`) is read as: every record that is not a block record,
// in full (a few per step), plus the block records downsampled by the backend
// (`buckets=BUCKETS`, min and max kept per bucket), so opening a finished 100k-record run moves
// a few thousand records, not 100k.

import { api } from "./api.js";

export const RAW_LIMIT = 20000;
export const PAGE = 5000;
export const BUCKETS = 1500;
const TAIL_SEQS = 1500;
const SOURCES = ["trainer", "strategy", "activation_stagehand", "conductor"];
const VRAM_FIELDS = "vram_allocated_mb,vram_reserved_mb"; // what the VRAM chart draws of a bucket

async function pages(runId, params, since = -1) {
  const out = [];
  let cursor = since;
  for (;;) {
    const page = await api.telemetry(runId, { ...params, since: cursor, limit: PAGE });
    const data = page.data || [];
    out.push(...data);
    const next = page.next_since ?? (data.length ? data[data.length - 1].seq : cursor);
    if (data.length < PAGE || next === cursor) break;
    cursor = next;
  }
  return out;
}

/**
 * Records of `run`, oldest first, and the seq the stream should resume after.
 * @returns {Promise<{records: object[], lastSeq: number, downsampled: boolean,
 *   buckets: object[]}>} `buckets`: a large run's block records, downsampled (see above)
 */
export async function loadHistory(run) {
  const total = (run.last_seq ?? -1) + 1;
  if (total <= RAW_LIMIT) {
    const records = await pages(run.id, {});
    const lastSeq = records.length ? records[records.length - 1].seq : -1;
    return { records, lastSeq, downsampled: false, buckets: [] };
  }
  // The buckets come from rollups made at ingest (~30 ms for 100k block records).
  const [buckets, ...parts] = await Promise.all([
    api.telemetry(run.id, { source: "stagehand", kind: "block", buckets: BUCKETS, since: -1, fields: VRAM_FIELDS })
      .then((p) => (p.data || []).filter((b) => b.seq <= run.last_seq)),
    ...SOURCES.map((source) => pages(run.id, { source })),
    pages(run.id, { source: "stagehand", kind: "step" }),
    // The residency map needs events, which buckets do not keep: the newest of them.
    pages(run.id, { source: "stagehand", kind: "block" }, Math.max(-1, (run.last_seq ?? 0) - TAIL_SEQS))
      .then((list) => list.map((r) => ({ ...r, residencyOnly: true }))),
  ]);
  const bySeq = new Map();
  for (const part of parts) for (const rec of part) bySeq.set(rec.seq, rec);
  // Cut at the run's last_seq as read before these requests: the stream replays everything
  // after it, so nothing (block records of a running run included) falls between the two.
  const lastSeq = run.last_seq;
  const records = [...bySeq.values()].filter((r) => r.seq <= lastSeq).sort((a, b) => a.seq - b.seq);
  return { records, lastSeq, downsampled: true, buckets };
}
