// Drives Spade's OpenAI-compatible API with the official `openai` npm client: non-streaming and streaming chat
// completions and a completion. Prints one JSON line with what it saw; exits non-zero (with the reason) on any
// mismatch. Run by tests/coordinator/test_openai_api.cpp against a running cluster on stories260K:
//   node chat.mjs http://127.0.0.1:PORT/v1 MODEL
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
if (!baseURL || !model) {
  console.error("usage: node chat.mjs BASE_URL MODEL");
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

let rejected = null;
try {
  await client.chat.completions.create({ model: "no-such-model", messages });
} catch (e) {
  rejected = e;
}
check(rejected instanceof OpenAI.NotFoundError, `unknown model raises NotFoundError, got ${rejected}`);

console.log(JSON.stringify({ ok: true, content: choice.message.content, streamed_chunks: chunks, usage: full.usage }));
