"""Question generators for the benchmarks: pure, seeded, and free of any I/O.

Every chat workload item carries a system prompt and a question. Questions come from *intents*: a
phrasing family (several wordings of one question with an entity slot) plus an entity, so the same
intent can be asked in many words (paraphrases) while different intents stay different questions.
Three long system prompts stand in for three applications sharing the broker; a merged call sends the
system prompt once for all its members, which is where the token savings come from.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

SYSTEM_PROMPTS: dict[str, str] = {
    "support": (
        "You are the customer support assistant of Nimbus Drive, a cloud storage and file sharing service "
        "for individuals and small teams. Plans: Free (5 GB, one device), Personal (2 TB, unlimited devices, "
        "30-day file history), Team (5 TB pooled, admin console, 180-day file history, single sign-on). "
        "Answer in plain language, in at most five short sentences or a numbered list of steps. Refer to "
        "menu items exactly as they appear in the apps: Settings, Security, Sharing, Billing, Devices, "
        "File history. Never ask for or repeat a password, a recovery code or full card numbers. When a "
        "question concerns an outage, say that status.nimbusdrive.example shows live service health. "
        "When a task can only be done by a team admin, say so first and explain what a member can do "
        "instead. If the answer depends on the plan, give the answer for each plan. If you do not know, "
        "say that a human agent can help through the Help menu and do not guess. Keep a friendly, calm "
        "and professional tone; do not use marketing language, emojis or exclamation marks."
    ),
    "cooking": (
        "You are Sous, the cooking assistant of a recipe website for home cooks. Give practical, safe "
        "advice for ordinary home kitchens with a standard oven, a stovetop and basic tools. Always use "
        "metric units first with imperial units in brackets, and temperatures in Celsius with Fahrenheit "
        "in brackets. Follow current food safety guidance: state safe internal temperatures for meat, "
        "poultry and fish, and say how long cooked food keeps in the fridge and the freezer. Mention the "
        "common allergens (gluten, dairy, eggs, nuts, peanuts, soy, fish, shellfish, sesame) when a "
        "suggested ingredient contains them. Prefer ingredients found in an ordinary supermarket. Keep "
        "answers under 120 words unless the user asks for a full recipe; use a short list when giving "
        "steps. Do not give medical or dietary treatment advice; suggest a professional instead. If a "
        "question is not about food, cooking, ingredients or kitchen equipment, politely say that you "
        "can only help with cooking."
    ),
    "travel": (
        "You are Wayfarer, the travel planning assistant of an online travel agency. Help travellers plan "
        "city trips: when to go, how to get around, what to see, what to eat, where to stay and how long "
        "to stay. Give concrete suggestions with neighbourhood names and approximate prices in the local "
        "currency with a euro estimate in brackets. Mention public transport before taxis and ride "
        "hailing, and walking where distances allow. Flag seasonal closures, public holidays and big "
        "events that change prices or crowds. For entry requirements, visas, vaccinations and safety, "
        "give general guidance only and tell the traveller to check the official government website of "
        "their own country before booking. Never invent opening hours or exact prices; say they change "
        "and should be checked. Keep answers under 150 words, structured as a short paragraph followed "
        "by at most five bullet points. Be warm and encouraging, and do not recommend specific hotels, "
        "airlines or tour operators by name."
    ),
}


@dataclass(frozen=True)
class Family:
    """A question with an entity slot `{x}`, in several wordings that all ask the same thing."""

    app: str
    wordings: tuple[str, ...]
    entities: tuple[str, ...]


_INGREDIENTS = (
    "chicken thighs", "a whole chicken", "salmon fillets", "pork shoulder", "lamb chops", "beef brisket",
    "sweet potatoes", "butternut squash", "broccoli", "cauliflower", "brussels sprouts", "carrots",
    "tofu", "chickpeas", "duck breast", "turkey breast", "cod fillets", "aubergine", "beetroot", "parsnips",
    "a leg of lamb", "pork belly", "new potatoes", "red peppers", "mushrooms", "fennel", "venison steaks",
    "halloumi", "courgettes", "shallots",
)
_CITIES = (
    "Lisbon", "Kyoto", "Vienna", "Mexico City", "Edinburgh", "Istanbul", "Copenhagen", "Buenos Aires",
    "Marrakesh", "Seoul", "Prague", "Cape Town", "Hanoi", "Montreal", "Seville", "Budapest", "Oaxaca",
    "Tbilisi", "Porto", "Krakow", "Singapore", "Naples", "Valletta", "Ljubljana", "Bergen", "Cartagena",
    "Hobart", "Quebec City", "Tallinn", "Bologna",
)
_TASKS = (
    "reset my password", "enable two-factor authentication", "share a folder with a colleague",
    "recover a deleted file", "change my billing plan", "download my invoices", "add a new device",
    "remove an old phone from my account", "restore an earlier version of a file", "change my email address",
    "stop syncing a folder on my laptop", "transfer ownership of a shared folder", "cancel my subscription",
    "free up storage space", "turn off automatic photo upload", "export all my files",
    "set an expiry date on a share link", "invite a member to my team", "change the language of the app",
    "see who opened a shared file", "password-protect a share link", "move files between two accounts",
    "update my payment card", "get a refund for last month", "sign out of all devices",
    "limit upload bandwidth", "find a file I uploaded last year", "merge two folders",
    "see how much storage I am using", "turn on single sign-on for my team",
)

FAMILIES: tuple[Family, ...] = (
    Family("cooking", (
        "How long should I roast {x}?",
        "What is the right roasting time for {x}?",
        "For how long do I roast {x} in the oven?",
        "How many minutes does {x} need when roasting?",
        "What roasting time do {x} need?",
        "How long do you roast {x} for?",
    ), _INGREDIENTS),
    Family("cooking", (
        "How should I store leftover cooked {x}, and for how long?",
        "How long do leftover cooked {x} keep, and how should I store them?",
        "What is the best way to store leftover cooked {x}, and how long are they good for?",
        "How do I keep leftover cooked {x} and how many days do they last?",
        "Storing leftover cooked {x}: how, and for how long?",
        "How long can I keep leftover cooked {x} and what is the right way to store them?",
    ), _INGREDIENTS),
    Family("cooking", (
        "What spices go well with {x}?",
        "Which spices pair well with {x}?",
        "What seasonings work best with {x}?",
        "Which spices should I use to season {x}?",
        "What are good spices to go with {x}?",
        "Which seasonings complement {x}?",
    ), _INGREDIENTS),
    Family("travel", (
        "What is the best time of year to visit {x}?",
        "When is the best season to travel to {x}?",
        "Which month is best for a trip to {x}?",
        "What time of year should I visit {x}?",
        "When should I go to {x} for the best weather?",
        "What is the ideal season for visiting {x}?",
    ), _CITIES),
    Family("travel", (
        "How do I get from the airport to the city centre in {x}?",
        "What is the best way to get from the airport into central {x}?",
        "How can I travel from the airport to downtown {x}?",
        "Which transport goes from the airport to the centre of {x}?",
        "What's the easiest way from {x} airport to the city centre?",
        "How do I reach the city centre of {x} from the airport?",
    ), _CITIES),
    Family("travel", (
        "What local dishes should I try in {x}?",
        "Which local foods should I eat in {x}?",
        "What traditional dishes are a must in {x}?",
        "What should I eat when I visit {x}?",
        "Which local specialities should I taste in {x}?",
        "What are the typical dishes to try in {x}?",
    ), _CITIES),
    Family("support", (
        "How do I {x}?",
        "How can I {x}?",
        "What are the steps to {x}?",
        "Can you tell me how to {x}?",
        "What is the way to {x}?",
        "I want to {x}. How do I do that?",
    ), _TASKS),
    Family("support", (
        "Can I {x} from the mobile app?",
        "Is it possible to {x} in the mobile app?",
        "Does the phone app let me {x}?",
        "Can I use the mobile app to {x}?",
        "Is there a way to {x} from my phone?",
        "Am I able to {x} with the mobile app?",
    ), _TASKS),
    Family("cooking", (
        "Can I cook {x} in an air fryer?",
        "Is it possible to cook {x} in an air fryer?",
        "Can {x} be cooked in an air fryer?",
        "Will {x} work in an air fryer?",
        "Can I make {x} in my air fryer?",
        "Is an air fryer good for cooking {x}?",
    ), _INGREDIENTS),
    Family("cooking", (
        "How do I know when {x} are cooked through?",
        "How can I tell when {x} are fully cooked?",
        "What is the sign that {x} are done?",
        "How do I check that {x} are cooked properly?",
        "When are {x} done cooking?",
        "How can I tell if {x} are cooked enough?",
    ), _INGREDIENTS),
    Family("travel", (
        "How many days do I need to see {x}?",
        "How many days should I spend in {x}?",
        "How long should a trip to {x} be?",
        "How much time do I need in {x}?",
        "Is three days enough for {x}, or do I need more?",
        "What is a good length for a visit to {x}?",
    ), _CITIES),
    Family("travel", (
        "Which neighbourhood should I stay in when visiting {x}?",
        "What is the best area to stay in {x}?",
        "Where should I stay in {x}?",
        "Which part of {x} is best for a first-time visitor to stay in?",
        "What neighbourhood do you recommend for a stay in {x}?",
        "Which district of {x} is good to stay in?",
    ), _CITIES),
    Family("travel", (
        "Is {x} expensive for tourists?",
        "How expensive is {x} for visitors?",
        "Is {x} a costly city to visit?",
        "How much money do I need per day in {x}?",
        "What is the daily budget for a tourist in {x}?",
        "Is a trip to {x} expensive?",
    ), _CITIES),
    Family("support", (
        "Why can't I {x}?",
        "Why am I unable to {x}?",
        "Why does it fail when I try to {x}?",
        "What stops me from being able to {x}?",
        "I can't {x}. Why not?",
        "Why is it not possible for me to {x}?",
    ), _TASKS),
    Family("support", (
        "Is there a fee to {x}?",
        "Does it cost anything to {x}?",
        "Do I have to pay to {x}?",
        "Is it free to {x}?",
        "Will I be charged if I {x}?",
        "Is there a charge when I {x}?",
    ), _TASKS),
    Family("support", (
        "Can a team admin {x} for me?",
        "Is my team admin able to {x} on my behalf?",
        "Could my admin {x} for me?",
        "Can an administrator {x} for a team member?",
        "Can I ask my team admin to {x} for me?",
        "Is it possible for the admin of my team to {x} for me?",
    ), _TASKS),
)


@dataclass(frozen=True)
class ChatItem:
    """One chat request of a workload: which application's system prompt, the question, and its kind.

    `kind` is "paraphrase" (a wording of an intent asked several times nearby), "repeat" (an exact
    repeat of an earlier question), "distinct" (an intent asked once) or "burst" (hot-question burst).
    """

    app: str
    question: str
    kind: str

    @property
    def system(self) -> str:
        """The application's system prompt."""
        return SYSTEM_PROMPTS[self.app]


@dataclass(frozen=True)
class MixShares:
    """Shares of a mixed workload's requests by kind; the rest are distinct questions."""

    paraphrase: float = 0.4
    repeat: float = 0.2
    cluster_size: int = 5
    cluster_span: int = 12  # a cluster's members land within this many consecutive requests


def _intent_keys() -> list[tuple[int, int]]:
    return [(f, e) for f, fam in enumerate(FAMILIES) for e in range(len(fam.entities))]


def _wording(family: Family, entity: int, wording: int) -> str:
    return family.wordings[wording % len(family.wordings)].replace("{x}", family.entities[entity])


def mixed_workload(n: int, *, seed: int = 1, shares: MixShares = MixShares()) -> list[ChatItem]:
    """`n` requests mixing paraphrase clusters, exact repeats and distinct questions over three system prompts.

    Each intent is used at most once per workload (as a cluster or a distinct question), so only
    paraphrases and repeats share answers. Cluster members are placed close together in arrival order,
    as a popular question is asked by many people around the same time.
    """
    rng = random.Random(seed)
    intents = _intent_keys()
    rng.shuffle(intents)
    n_clusters = round(n * shares.paraphrase / shares.cluster_size)
    n_repeat = round(n * shares.repeat)
    n_distinct = n - n_clusters * shares.cluster_size - n_repeat
    if n_clusters + n_distinct > len(intents):
        raise ValueError(f"{n} requests need more intents than the {len(intents)} available")
    slots: list[ChatItem | None] = [None] * n
    free = list(range(n))
    for _ in range(n_clusters):
        f, e = intents.pop()
        wordings = rng.sample(range(len(FAMILIES[f].wordings)), min(shares.cluster_size, len(FAMILIES[f].wordings)))
        start = rng.randrange(n)
        for k in range(shares.cluster_size):
            index = _nearest_free(free, start + rng.randrange(shares.cluster_span), rng)
            slots[index] = ChatItem(FAMILIES[f].app, _wording(FAMILIES[f], e, wordings[k % len(wordings)]),
                                    "paraphrase")
    for _ in range(n_distinct):
        f, e = intents.pop()
        index = free.pop(rng.randrange(len(free)))
        slots[index] = ChatItem(FAMILIES[f].app, _wording(FAMILIES[f], e, rng.randrange(6)), "distinct")
    return _fill_repeats(slots, rng)


def _nearest_free(free: list[int], target: int, rng: random.Random) -> int:
    """Take the free slot closest to `target` (ties broken at random) out of the sorted list `free`."""
    i = bisect.bisect_left(free, target)
    candidates = [j for j in (i - 1, i) if 0 <= j < len(free)]
    best = min(candidates, key=lambda j: (abs(free[j] - target), rng.random()))
    return free.pop(best)


def _fill_repeats(slots: list[ChatItem | None], rng: random.Random) -> list[ChatItem]:
    """Fill the empty slots with exact repeats of a question asked earlier (or later, for leading gaps)."""
    asked = [s for s in slots if s is not None]
    out: list[ChatItem] = []
    for slot in slots:
        if slot is None:
            source = rng.choice(out or asked)
            slot = ChatItem(source.app, source.question, "repeat")
        out.append(slot)
    return out


_HOT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("support", (
        "Is Nimbus Drive down right now?", "Is Nimbus Drive currently down?",
        "Is Nimbus Drive down at the moment?", "Is Nimbus Drive down today?",
        "Is Nimbus Drive down now?", "Is Nimbus Drive down at present?",
    )),
    ("support", (
        "Why are my files not syncing?", "Why did my files stop syncing?",
        "Why won't my files sync?", "Why aren't my files syncing anymore?",
        "Why are my files not syncing today?", "Why do my files not sync?",
    )),
    ("cooking", (
        "How long should I cook a turkey?", "How long do I cook a turkey for?",
        "How long does a turkey take to cook?", "What is the cooking time for a turkey?",
        "How many hours should a turkey cook?", "How long should a turkey be cooked?",
    )),
    ("cooking", (
        "Can I freeze cooked rice?", "Is it safe to freeze cooked rice?", "Can cooked rice be frozen?",
        "Is freezing cooked rice safe?", "Can I put cooked rice in the freezer?",
        "Is it okay to freeze cooked rice?",
    )),
    ("travel", (
        "Do I need a visa to visit Japan?", "Is a visa required to visit Japan?",
        "Do I need a visa for a trip to Japan?", "Is a visa needed to travel to Japan?",
        "Does visiting Japan require a visa?", "Do I have to get a visa to visit Japan?",
    )),
    ("travel", (
        "Is the Lisbon metro open during the strike?", "Is the Lisbon metro running during the strike?",
        "Is the metro in Lisbon open during the strike?", "Does the Lisbon metro run during the strike?",
        "Will the Lisbon metro be open during the strike?", "Is the Lisbon metro working during the strike?",
    )),
)
_PREFIXES = ("", "Quick question: ", "Hi, ", "Hello! ", "Hey, ")
_SUFFIXES = ("", " Thanks.", " Thank you!")


def hot_question_versions(topic: int, count: int = 30, *, seed: int = 1) -> list[ChatItem]:
    """`count` differently worded versions of hot question `topic` (core wording x greeting x thanks).

    No two versions are equal even after lower-casing and collapsing whitespace, so neither the cache
    nor in-flight coalescing can answer one from another: only merging can save calls.
    """
    app, cores = _HOT[topic % len(_HOT)]
    combos = [p + c + s for c in cores for p in _PREFIXES for s in _SUFFIXES]
    if count > len(combos):
        raise ValueError(f"at most {len(combos)} versions of a hot question")
    picked = random.Random(seed * 1009 + topic).sample(combos, count)
    return [ChatItem(app, q, "burst") for q in picked]


def hot_question_topics() -> int:
    """How many distinct hot questions `hot_question_versions` can word."""
    return len(_HOT)


_EMBED_SUBJECTS = (*(f"{t} on Nimbus Drive" for t in _TASKS), *(f"cooking {i}" for i in _INGREDIENTS),
                   *(f"a weekend in {c}" for c in _CITIES))
_EMBED_FRAMES = (
    "Notes on {s}, version {n}.", "A short review of {s} (entry {n}).", "Frequently asked: {s}? Ticket {n}.",
    "Summary {n}: everything about {s}.", "Draft {n} of a blog post about {s}.",
)


def distinct_texts(n: int, *, namespace: str = "", start: int = 0) -> list[str]:
    """`n` different short texts (a dozen words each), unique within `namespace` for every index from `start`."""
    texts = []
    for i in range(start, start + n):
        subject = _EMBED_SUBJECTS[i % len(_EMBED_SUBJECTS)]
        frame = _EMBED_FRAMES[(i // len(_EMBED_SUBJECTS)) % len(_EMBED_FRAMES)]
        texts.append(f"{namespace}{frame.replace('{s}', subject).replace('{n}', str(i))}")
    return texts


def with_repeats(n: int, *, repeat_share: float, seed: int = 1, namespace: str = "") -> list[str]:
    """`n` texts of which `repeat_share` are exact repeats of a text that came earlier in the list."""
    rng = random.Random(seed)
    n_repeat = round(n * repeat_share)
    fresh = iter(distinct_texts(n - n_repeat, namespace=namespace))
    repeat_at = set(rng.sample(range(1, n), n_repeat)) if n_repeat else set()
    out: list[str] = []
    for i in range(n):
        out.append(rng.choice(out) if i in repeat_at else next(fresh))
    return out
