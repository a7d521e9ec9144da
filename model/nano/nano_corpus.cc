// Training text for the nano model's byte-level BPE tokenizer (our own prose and code).
// Changing this text changes the nano tokenizer, the vocab size and every generated checkpoint.

#include <string_view>

namespace epd::model {

std::string_view NanoCorpus() {
  static constexpr std::string_view kText = R"corpus(
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the forest.
A small model is a good model for tests: it loads fast, it runs fast, and it still has every part of the big one.
We serve large language models. A request arrives with a prompt; the encoder reads the prompt, the prefill
stage builds the cache, and the decode stage writes one token after another until the answer is complete.
The system keeps the key and value cache in memory, moves it between machines, and stores it on disk when
the same prefix comes back later. Good engineering means simple interfaces, clear errors, and tests that fail
when something is wrong. Every number has a unit; every buffer has a shape; every thread knows what it owns.

Once upon a time there was a little robot who wanted to learn how to read. Every morning it opened a book and
looked at the letters. At first the letters were only shapes, but after many days the shapes became words,
and the words became stories. The robot read about the sea, about mountains and rivers, about cities full of
people, and about the stars that shine at night. When the robot finished the last book in the library, it
asked the librarian for more. "There are no more books," said the librarian, "so now you must write your own."

User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum, and its cafes.
User: How many days are there in a week?
Assistant: There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
User: Can you explain what a transformer is?
Assistant: A transformer is a neural network that uses attention. Each token looks at the other tokens,
computes a weighted sum of their values, and passes the result through a feed-forward network. Many layers
are stacked, and the output of the last layer predicts the next token.
User: Please think step by step. If a train travels 120 kilometers in 2 hours, what is its speed?
Assistant: The speed is distance divided by time: 120 / 2 = 60 kilometers per hour.

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 65536 1048576.
On 2026-11-30 at 09:45:00 UTC the build finished in 12.5 seconds; 3 of 400 tests were skipped, 0 failed.
Prices: $19.99, $250, 3.14159, 2.71828, 1e-6, 0.5, 100%, 42 is the answer, version 4.1, port 8080.

Weather report: today will be sunny in the morning and cloudy in the afternoon, with a light wind from the
west. Tomorrow there is a chance of rain in the evening. The temperature will be between 12 and 18 degrees.
Cooking: heat the oil in a pan, add the onions and cook them until they are soft. Add the tomatoes, the salt
and the pepper, and let the sauce simmer for twenty minutes. Serve it hot with pasta and fresh bread.
History: the printing press changed the way people shared knowledge. Books became cheaper, more people
learned to read, and new ideas spread across the world faster than ever before.
Science: water boils at 100 degrees Celsius at sea level. Light travels at about 300000 kilometers per
second. The earth turns around the sun once a year and around its own axis once a day.

// C++: a function that adds two numbers and a class with a status result.
#include <cstdint>
#include <string>
#include <vector>

namespace example {

int Add(int a, int b) { return a + b; }

class Cache {
 public:
  explicit Cache(size_t capacity) : capacity_(capacity) {}
  absl::Status Put(const std::string& key, std::vector<uint8_t> value) {
    if (value.size() > capacity_) {
      return absl::InvalidArgumentError("value is larger than the cache");
    }
    entries_[key] = std::move(value);
    return absl::OkStatus();
  }
  std::optional<std::vector<uint8_t>> Get(const std::string& key) const {
    auto it = entries_.find(key);
    if (it == entries_.end()) return std::nullopt;
    return it->second;
  }

 private:
  size_t capacity_;
  std::map<std::string, std::vector<uint8_t>> entries_;
};

for (int i = 0; i < n; ++i) {
  sum += values[i] * weights[i];
}
if (status.ok()) {
  return result;
} else {
  return status;
}

}  // namespace example

# Python: read a file, count the words, print the most common ones.
import collections
import json
import sys


def count_words(path):
    counts = collections.Counter()
    with open(path, "r", encoding="utf-8") as handle:
        for line in handle:
            for word in line.split():
                counts[word.lower()] += 1
    return counts


def main():
    counts = count_words(sys.argv[1])
    for word, count in counts.most_common(10):
        print(f"{word}: {count}")
    print(json.dumps({"total": sum(counts.values())}))


if __name__ == "__main__":
    main()

class Model:
    def __init__(self, config):
        self.config = config
        self.layers = [Layer(i) for i in range(config["num_layers"])]

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)

{"model": "nano", "hidden_size": 256, "num_layers": 12, "vocab_size": 2048, "tokens": [1, 2, 3]}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "result": {"temp": 18}}

SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY count(*) DESC LIMIT 10;
$ cmake -S . -B build && cmake --build build -j2 && ctest --output-on-failure
$ git add model/tokenizer.cc && git commit -m "model: tokenizer"

Markdown:
# Title
## Section
- first item
- second item
1. step one
2. step two
**bold** and *italic* and `code` and [a link](https://example.com/path?query=1).

The weather is nice today. The weather was nice yesterday. The weather will be nice tomorrow.
I think that this is a good idea. I think that we should try it. I think that it will work.
She said that she would come, and she came. He said that he would help, and he helped.
They were reading, writing, running, testing, building, serving, caching, and decoding all day long.
Questions and answers: why, what, when, where, who, which, how. Because, therefore, however, although.
In the beginning the tokens are bytes; then the most frequent pairs are merged; then the merged pairs are
merged again, until the vocabulary has the size that we want.

Animals: elephant, giraffe, zebra, penguin, dolphin, octopus, butterfly, squirrel, rabbit, hedgehog, kangaroo,
crocodile, flamingo, jellyfish, leopard, panther, buffalo, camel, donkey, parrot, sparrow, eagle, owl, whale.
Tools and things: hammer, screwdriver, wrench, ladder, bucket, blanket, pillow, umbrella, backpack, bicycle,
helicopter, submarine, telescope, microscope, keyboard, monitor, printer, scissors, envelope, calendar, candle.
Feelings: happy, sad, angry, curious, anxious, grateful, proud, jealous, relieved, surprised, confused, calm.
Verbs: accept, achieve, adjust, allocate, analyze, approve, archive, assemble, balance, borrow, calculate,
celebrate, challenge, collect, compare, compile, compress, configure, connect, deliver, deploy, describe,
discover, distribute, download, encrypt, estimate, evaluate, examine, execute, expand, explore, forward,
generate, govern, hesitate, identify, ignore, imagine, improve, include, initialize, inspect, install,
integrate, interrupt, investigate, justify, launch, maintain, measure, migrate, monitor, negotiate, observe,
optimize, organize, overwrite, participate, persist, predict, prepare, preserve, publish, qualify, recover,
reduce, register, release, remember, replace, replicate, request, resolve, restore, retrieve, schedule,
serialize, simplify, subscribe, succeed, summarize, suspend, synchronize, terminate, translate, validate.
Nouns: abstraction, algorithm, allocation, architecture, argument, assertion, bandwidth, benchmark, boundary,
callback, capacity, checkpoint, cluster, component, concurrency, condition, container, controller, coordinate,
database, deadline, dependency, descriptor, dictionary, directory, document, element, encoding, endpoint,
exception, expression, extension, failure, framework, function, gateway, gradient, handler, heuristic,
identifier, implementation, increment, inference, instance, interface, iterator, journal, kernel, latency,
library, literal, machine, manifest, matrix, metadata, module, namespace, network, notification, operator,
parameter, partition, pipeline, pointer, position, precision, priority, procedure, process, protocol, queue,
quantization, reference, registry, repository, resource, response, runtime, scheduler, segment, sequence,
session, signature, snapshot, specification, statement, storage, structure, template, tensor, throughput,
timestamp, transaction, transport, variable, vector, version, volume, warning, workload.
Places: airport, bakery, beach, bridge, castle, cathedral, desert, factory, garden, harbor, hospital, island,
jungle, kitchen, laboratory, lighthouse, market, meadow, museum, office, palace, prison, railway, restaurant,
school, stadium, station, temple, theater, tunnel, university, valley, village, volcano, waterfall.
Food: apple, banana, cherry, grape, lemon, mango, orange, peach, pear, pineapple, strawberry, watermelon,
bread, butter, cheese, chocolate, cookie, noodle, omelette, pancake, potato, rice, salad, sandwich, soup.

Other languages: Bonjour, ça va? Très bien, merci. ¿Dónde está la biblioteca? Größe, Straße, über, naïve café.
中文：你好，世界。今天天气很好。我们在测试分词器。日本語：こんにちは、世界。カタカナとひらがな。
한국어: 안녕하세요. Русский: привет, мир. Ελληνικά: γεια σου κόσμε. Emoji: 🙂 🚀 ✅ ❤️ 👍.
Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14, 2 × 3 = 6, 10 ÷ 2 = 5, a ≠ b, x → y.

<think>
The user asks for the sum of the numbers from one to ten. The sum is ten times eleven divided by two,
which is fifty-five. I should answer briefly.
</think>
The sum of the numbers from 1 to 10 is 55.

<tool_result>{"temperature": 21, "condition": "sunny"}</tool_result>
It is 21 degrees and sunny in the city right now.
)corpus";
  return kText;
}

}  // namespace epd::model
