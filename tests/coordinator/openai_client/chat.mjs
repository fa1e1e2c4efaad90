// Drives Spade's OpenAI-compatible API with the official `openai` npm client: non-streaming and streaming chat
// completions and a completion, logprobs on both (whole and streamed), n > 1 on both (whole and streamed), and a
// repeated long prompt that hits the inference rank's prefix cache (its vllm:prefix_cache_hits_total moves by at least
// a page more than on the prompt's first request; both TTFTs are printed). Prints one JSON line with what it saw;
// exits non-zero (with the reason) on any mismatch. Run by tests/coordinator/test_openai_api.cpp against a running
// cluster on stories260K:
//   node chat.mjs http://127.0.0.1:PORT/v1 MODEL http://127.0.0.1:INFERENCE_METRICS_PORT/metrics
import OpenAI from "openai";

const [baseURL, model, metricsURL] = process.argv.slice(2);
if (!baseURL || !model || !metricsURL) {
  console.error("usage: node chat.mjs BASE_URL MODEL INFERENCE_RANK_METRICS_URL");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 60_000 });

function check(cond, what) {
  if (!cond) {
    console.error(`openai client check failed: ${what}`);
    process.exit(1);
  }
}

const models = await client.models.list();
check(models.data.some((m) => m.id === model), `models.list() has ${model}: ${JSON.stringify(models.data)}`);

const messages = [{ role: "user", content: "Once upon a time" }];
const full = await client.chat.completions.create({ model, messages, max_tokens: 24, temperature: 0 });
check(full.object === "chat.completion", `object is chat.completion: ${full.object}`);
const choice = full.choices[0];
check(choice.message.role === "assistant", "assistant message");
check(typeof choice.message.content === "string" && choice.message.content.length > 0, "non-empty content");
check(choice.finish_reason === "length" || choice.finish_reason === "stop", `finish_reason ${choice.finish_reason}`);
check(full.usage.completion_tokens > 0 && full.usage.total_tokens === full.usage.prompt_tokens + full.usage.completion_tokens,
      `usage ${JSON.stringify(full.usage)}`);

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 24, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let text = "";
let chunks = 0;
let finish = null;
let usage = null;
for await (const chunk of stream) {
  check(chunk.object === "chat.completion.chunk", `chunk object ${chunk.object}`);
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    if (c.delta?.content) text += c.delta.content;
    if (c.finish_reason) finish = c.finish_reason;
  }
  chunks++;
}
check(text === choice.message.content, `streamed text ${JSON.stringify(text)} equals the non-streamed ${JSON.stringify(choice.message.content)}`);
check(finish === choice.finish_reason, `stream finish_reason ${finish}`);
check(usage && usage.completion_tokens === full.usage.completion_tokens, `stream usage ${JSON.stringify(usage)}`);

const completion = await client.completions.create({ model, prompt: "Once upon a time", max_tokens: 8, temperature: 0 });
check(completion.choices[0].text.length > 0, "completion text");

// logprobs: chat (logprobs + top_logprobs, whole and streamed) and completions (integer logprobs), OpenAI's shapes;
// exp(logprob) of the alternatives sums to <= 1, and the sampled token's logprob equals its entry among them.
function checkChatLogprobs(content, top, what) {
  check(Array.isArray(content) && content.length > 0, `${what}: logprobs.content is a non-empty array`);
  for (const e of content) {
    check(typeof e.token === "string" && typeof e.logprob === "number" && e.logprob <= 0, `${what}: entry ${JSON.stringify(e)}`);
    check(Array.isArray(e.bytes) && e.bytes.every((b) => Number.isInteger(b) && b >= 0 && b < 256), `${what}: bytes ${JSON.stringify(e.bytes)}`);
    check(Array.isArray(e.top_logprobs) && e.top_logprobs.length === top, `${what}: ${top} top_logprobs in ${JSON.stringify(e)}`);
    let mass = 0;
    for (const t of e.top_logprobs) {
      check(typeof t.token === "string" && typeof t.logprob === "number" && Array.isArray(t.bytes), `${what}: alternative ${JSON.stringify(t)}`);
      mass += Math.exp(t.logprob);
      if (JSON.stringify(t.bytes) === JSON.stringify(e.bytes))
        check(t.logprob === e.logprob, `${what}: the sampled token's logprob ${e.logprob} equals its alternative's ${t.logprob}`);
    }
    check(mass <= 1 + 1e-5, `${what}: exp(top logprobs) sums to ${mass} <= 1`);
  }
}
const lpFull = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0.8, seed: 3, logprobs: true, top_logprobs: 4 });
checkChatLogprobs(lpFull.choices[0].logprobs?.content, 4, "chat logprobs");
check(lpFull.choices[0].logprobs.content.length === lpFull.usage.completion_tokens, "one logprobs entry per completion token");
const lpStream = await client.chat.completions.create({
  model, messages, max_tokens: 12, temperature: 0.8, seed: 3, logprobs: true, top_logprobs: 4, stream: true,
});
const lpStreamed = [];
for await (const chunk of lpStream)
  for (const c of chunk.choices) if (c.logprobs?.content) lpStreamed.push(...c.logprobs.content);
checkChatLogprobs(lpStreamed, 4, "streamed chat logprobs");
check(JSON.stringify(lpStreamed) === JSON.stringify(lpFull.choices[0].logprobs.content),
      "streamed logprobs equal the non-streamed ones (same seed)");
const lpCompletion = await client.completions.create({ model, prompt: "Once upon a time", max_tokens: 8, temperature: 0, logprobs: 3 });
const clp = lpCompletion.choices[0].logprobs;
check(clp && Array.isArray(clp.tokens) && clp.tokens.length === lpCompletion.usage.completion_tokens &&
      clp.token_logprobs.length === clp.tokens.length && clp.top_logprobs.length === clp.tokens.length &&
      clp.text_offset.length === clp.tokens.length && clp.text_offset[0] === 0,
      `completion logprobs shape ${JSON.stringify(clp)}`);
for (let i = 0; i < clp.tokens.length; ++i) {
  const top = clp.top_logprobs[i];
  check(top[clp.tokens[i]] === clp.token_logprobs[i], `completion: the sampled token's entry in ${JSON.stringify(top)}`);
  const mass = Object.values(top).reduce((a, v) => a + Math.exp(v), 0);
  check(mass <= 1 + 1e-5, `completion: exp(top logprobs) sums to ${mass} <= 1`);
}

// n > 1: n choices (index 0..n-1, each a sample with seed + i), streamed and not; streamed chunks carry their
// choice's index, and usage counts the prompt once and every choice's tokens.
const nFull = await client.chat.completions.create({ model, messages, max_tokens: 12, temperature: 1, seed: 21, n: 3 });
check(nFull.choices.length === 3 && nFull.choices.every((c, i) => c.index === i && c.message.role === "assistant" &&
      typeof c.message.content === "string" && c.finish_reason),
      `n = 3: three indexed choices ${JSON.stringify(nFull.choices)}`);
check(new Set(nFull.choices.map((c) => c.message.content)).size > 1, "n = 3 at temperature 1: the samples differ");
check(nFull.usage.prompt_tokens === full.usage.prompt_tokens, `n = 3: the prompt counts once ${JSON.stringify(nFull.usage)}`);
const nStream = await client.chat.completions.create({
  model, messages, max_tokens: 12, temperature: 1, seed: 21, n: 3, stream: true, stream_options: { include_usage: true },
});
const nText = ["", "", ""];
const nFinish = [null, null, null];
let nUsage = null;
for await (const chunk of nStream) {
  if (chunk.usage) nUsage = chunk.usage;
  for (const c of chunk.choices) {
    check(Number.isInteger(c.index) && c.index >= 0 && c.index < 3, `n = 3: streamed choice index ${c.index}`);
    if (c.delta?.content) nText[c.index] += c.delta.content;
    if (c.finish_reason) nFinish[c.index] = c.finish_reason;
  }
}
for (let i = 0; i < 3; ++i) {
  check(nText[i] === nFull.choices[i].message.content, `n = 3: streamed choice ${i} ${JSON.stringify(nText[i])} equals the non-streamed ${JSON.stringify(nFull.choices[i].message.content)}`);
  check(nFinish[i] === nFull.choices[i].finish_reason, `n = 3: streamed choice ${i} finish_reason ${nFinish[i]}`);
}
check(nUsage && nUsage.completion_tokens === nFull.usage.completion_tokens && nUsage.prompt_tokens === nFull.usage.prompt_tokens,
      `n = 3: stream usage ${JSON.stringify(nUsage)}`);
const nCompletion = await client.completions.create({ model, prompt: "Once upon a time", max_tokens: 8, temperature: 1, seed: 4, n: 2 });
check(nCompletion.choices.length === 2 && nCompletion.choices.every((c, i) => c.index === i && typeof c.text === "string"),
      `completions n = 2: ${JSON.stringify(nCompletion.choices)}`);
const nCompletionStream = await client.completions.create({
  model, prompt: "Once upon a time", max_tokens: 8, temperature: 1, seed: 4, n: 2, stream: true,
});
const nCompletionText = ["", ""];
for await (const chunk of nCompletionStream) for (const c of chunk.choices) nCompletionText[c.index] += c.text;
check(nCompletionText.every((t, i) => t === nCompletion.choices[i].text),
      `completions n = 2: streamed ${JSON.stringify(nCompletionText)} equal the non-streamed`);

// Prefix caching: the same long prompt twice. The rank reuses the prompt's whole pages (16 tokens) but the last ones it
// recomputes for the sparse path's query window, so the prompt is well past a few pages.
async function prefixHits() {
  const res = await fetch(metricsURL);
  check(res.ok, `GET ${metricsURL}: ${res.status}`);
  let sum = 0;
  for (const line of (await res.text()).split("\n"))
    if (line.startsWith("vllm:prefix_cache_hits_total")) sum += Number(line.split(" ").pop());
  return sum;
}
async function ttft(content) {
  const t0 = performance.now();
  const s = await client.chat.completions.create({
    model, messages: [{ role: "user", content }], max_tokens: 4, temperature: 0, stream: true,
  });
  let first = null;
  for await (const chunk of s) if (first === null && chunk.choices.length && chunk.choices[0].delta.content) first = performance.now();
  return (first ?? performance.now()) - t0;
}
const longPrompt = "Lily and Tom went to the park to play with the big red ball. They ran and laughed in the sun. ".repeat(12);
const hits0 = await prefixHits();
const ttftCold = await ttft(longPrompt);
const hits1 = await prefixHits();
const ttftWarm = await ttft(longPrompt);
const hits2 = await prefixHits();
check(hits2 - hits1 >= hits1 - hits0 + 16,
      `a repeated prompt hits the prefix cache: hits ${hits0} -> ${hits1} (first) -> ${hits2} (repeat)`);

let rejected = null;
try {
  await client.chat.completions.create({ model: "no-such-model", messages });
} catch (e) {
  rejected = e;
}
check(rejected instanceof OpenAI.NotFoundError, `unknown model raises NotFoundError, got ${rejected}`);

console.log(JSON.stringify({ ok: true, content: choice.message.content, streamed_chunks: chunks, usage: full.usage,
                             logprob_entries: lpFull.choices[0].logprobs.content.length,
                             samples: nFull.choices.map((c) => c.message.content),
                             prefix_cache: { hit_tokens_first: hits1 - hits0, hit_tokens_repeat: hits2 - hits1,
                                             ttft_first_ms: ttftCold, ttft_repeat_ms: ttftWarm } }));
