// Structured output as agent frameworks send it (issue 54), with the frameworks' own packages
// from npm against the two real clusters of tests/e2e/openai_api_test.cc (EPD_BASE_URL: DSpark
// on, EPD_BASE_URL_OFF: DSpark off) on the random-weights nano model:
//   - the Vercel AI SDK: `ai` generateObject through `@ai-sdk/openai-compatible`
//     (supportsStructuredOutputs: response_format json_schema, the schema from zod v4's
//     toJSONSchema, no `strict`);
//   - LangChain: `@langchain/openai` ChatOpenAI.withStructuredOutput, method jsonSchema (strict,
//     the schema through the openai SDK's zod helper) and functionCalling (a forced tool call).
// A zod schema with min/max/length bounds, formats, nullable, enum and nested arrays of objects
// (Person; a smaller one, Weather, for the forced tool call); every output is checked by the
// zod schema it was requested with (the frameworks check it too) and every number
// in it must be a finite double. SEEDS seeds per client (default 6; the issue asks for 20 over
// the whole suite: 6 + 6 + 6 + 3 = 21 requests here, to keep this under ~60 s on 2 cores).
// Exits non-zero on the first failure; prints ALL OK at the end.
import assert from 'node:assert/strict';
import { z } from 'zod';
import { generateObject } from 'ai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { ChatOpenAI } from '@langchain/openai';
import OpenAI from 'openai';

const SEEDS = Number(process.env.EPD_AGENT_SEEDS ?? 6);
const MAX_TOKENS = 400;
// LangChain refuses a response whose finish_reason is 'length' ("Could not parse response content
// as the length limit was reached") although the grammar keeps it complete and valid. Person has
// fields of unbounded length (a plain number's fraction digits, the email's local part), and the
// random nano model can fill them until the budget closes the object, so LangChain gets room.
const LANGCHAIN_MAX_TOKENS = 2000;
const model = 'epd-nano';
const prompt = 'Describe a person as JSON';

const Friend = z.object({
  name: z.string().min(1).max(8),
  since: z.number().int().min(1900).max(2100),
});
const Person = z.object({
  name: z.string().min(1).max(12),
  age: z.number().int().min(0).max(150),
  score: z.number().min(-1.5).max(2.25),
  ratio: z.number().gt(0).lt(1),
  step: z.number().multipleOf(0.25).min(0).max(10),
  height: z.number(),
  email: z.email(),
  id: z.uuid(),
  nickname: z.string().max(5).nullable(),
  role: z.enum(['admin', 'user', 'guest']),
  tags: z.array(z.string().min(2).max(4)).min(1).max(3),
  born: z.iso.date(),
  friends: z.array(Friend).max(2),
});

// For forced tool calls: each parameter is wrapped in DSML markup (~70 bytes), and the grammar
// keeps the output completable within max_tokens counting a byte per token, so a schema as
// large as Person needs over 1000 tokens there; a smaller one keeps the test short.
const Weather = z.object({
  city: z.string().min(2).max(10),
  days: z.number().int().min(1).max(14),
  unit: z.enum(['c', 'f']).nullable(),
  temp: z.number().gt(-90).lt(60),
  at: z.iso.date(),
});

// Every number in the value is a finite double (JSON.parse turns 1e400 into Infinity).
function assertFinite(value, where) {
  if (typeof value === 'number') {
    assert.ok(Number.isFinite(value), `${where}: non-finite number ${value}`);
  } else if (Array.isArray(value)) {
    value.forEach((v, i) => assertFinite(v, `${where}[${i}]`));
  } else if (value && typeof value === 'object') {
    for (const [k, v] of Object.entries(value)) assertFinite(v, `${where}.${k}`);
  }
}

function check(label, seed, value, schema = Person) {
  const r = schema.safeParse(value);
  assert.ok(r.success, `${label} seed ${seed}: ${JSON.stringify(value)}: ${r.error?.message}`);
  assertFinite(value, `${label} seed ${seed}`);
}

async function aiSdk(baseURL, label) {
  const provider = createOpenAICompatible({
    name: 'epd', baseURL, apiKey: 'none', supportsStructuredOutputs: true,
  });
  const results = await Promise.all(Array.from({ length: SEEDS }, (_, seed) =>
    generateObject({
      model: provider(model), schema: Person, prompt, seed, temperature: 1,
      maxOutputTokens: MAX_TOKENS, maxRetries: 0,
    }).catch((e) => assert.fail(`${label} seed ${seed}: ${e.message} ${e.text ?? ''}`))));
  results.forEach((r, seed) => check(label, seed, r.object));
  console.log(`ok ${label}: ${SEEDS}/${SEEDS} generateObject outputs validate; e.g.`,
    JSON.stringify(results[0].object));
}

async function langChain(baseURL, method, seeds, label, schema) {
  const results = await Promise.all(Array.from({ length: seeds }, (_, seed) => {
    const llm = new ChatOpenAI({
      model, apiKey: 'none', configuration: { baseURL }, temperature: 1, maxTokens: LANGCHAIN_MAX_TOKENS,
      maxRetries: 0, modelKwargs: { seed: 100 + seed },
    });
    return llm.withStructuredOutput(schema, { name: 'answer', method, strict: true, includeRaw: true })
      .invoke(prompt)
      .catch((e) => assert.fail(`${label} seed ${seed}: ${e.message}`));
  }));
  results.forEach((v, seed) => {
    const raw = v.raw;
    assert.ok(v.parsed !== undefined && v.parsed !== null, `${label} seed ${seed}: nothing parsed from ` +
      JSON.stringify({ content: raw?.content, tool_calls: raw?.tool_calls,
        invalid: raw?.invalid_tool_calls, kw: raw?.additional_kwargs }));
    check(label, seed, v.parsed, schema);
  });
  console.log(`ok ${label}: ${seeds}/${seeds} withStructuredOutput outputs validate; e.g.`,
    JSON.stringify(results[0].parsed));
}

async function main() {
  const t0 = Date.now();
  const on = process.env.EPD_BASE_URL, off = process.env.EPD_BASE_URL_OFF;
  await Promise.all([
    aiSdk(on, 'ai-sdk (DSpark on)'),
    aiSdk(off, 'ai-sdk (DSpark off)'),
    langChain(on, 'jsonSchema', SEEDS, 'langchain jsonSchema', Person),
    langChain(off, 'functionCalling', Math.max(1, SEEDS >> 1), 'langchain functionCalling',
      Weather),
  ]);

  // strict: false is best effort: a keyword outside the subset is ignored, not refused, and the
  // rest of the schema is still enforced. strict: true (or absent) names it in a 400.
  const client = new OpenAI({ apiKey: 'none', maxRetries: 0, timeout: 120000, baseURL: on });
  const schema = {
    type: 'object',
    properties: { n: { type: 'integer', minimum: 1, maximum: 9, not: { const: 5 } } },
    required: ['n'],
    additionalProperties: false,
  };
  const lenient = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: prompt }], max_tokens: 16, temperature: 1, seed: 1,
    response_format: { type: 'json_schema', json_schema: { name: 'n', schema, strict: false } },
  });
  const n = JSON.parse(lenient.choices[0].message.content).n;
  assert.ok(Number.isInteger(n) && n >= 1 && n <= 9, lenient.choices[0].message.content);
  try {
    await client.chat.completions.create({
      model, messages: [{ role: 'user', content: prompt }], max_tokens: 16,
      response_format: { type: 'json_schema', json_schema: { name: 'n', schema, strict: true } },
    });
    assert.fail('strict true accepted an unsupported keyword');
  } catch (e) {
    assert.ok(e instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${e}`);
    assert.match(e.message, /'not'/);
  }
  console.log('ok strict false ignores an unsupported keyword, strict true names it');
  console.log(`ALL OK (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
}

main().catch((e) => {
  console.error('FAIL', e);
  process.exit(1);
});
